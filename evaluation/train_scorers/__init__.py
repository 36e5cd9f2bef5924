"""Scorers trained for a model, offline: ``python -m evaluation.train_scorers <command>``.

- ``corpus``: extract the training corpus (third-party docstrings, :mod:`.corpus_extract`) into the committed files
  that :mod:`.corpus` reads (train and held-out documents as token ids, for any scorer);
- ``kvzap``: KVzap's linear and MLP surrogates (arXiv 2601.07891) trained on the KVzip+ scores of the project's
  KVzip path (:mod:`.kvzap`: :mod:`.targets`, :mod:`.moments`, :mod:`.ridge`, :mod:`.mlp`, :mod:`.save`,
  :mod:`.heldout_fit`), saved where ``evaluation.scorers`` attaches them to kvpress's ``KVzapPress``.

:mod:`.disjoint` checks that the corpus shares no 64-token window with the evaluation sets.
"""
