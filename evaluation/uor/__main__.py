"""``python -m evaluation.uor``: the UOR study's Hydra entry point (:func:`evaluation.uor.study.main`)."""

from evaluation.uor.study import main

if __name__ == "__main__":
    main()
