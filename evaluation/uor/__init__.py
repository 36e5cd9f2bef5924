"""Paper 000's UOR analysis (docs/methods.md §2): the head-independent replay and its certificates
(:mod:`evaluation.uor.replay`), the page and byte accounting (:mod:`evaluation.uor.pages`) and the study on a model
(:mod:`evaluation.uor.study`, ``python -m evaluation.uor``). Analysis, not library: nothing under ``presses/``
imports it."""
