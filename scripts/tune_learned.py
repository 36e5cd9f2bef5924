"""The search for the defaults of the presses on KVzap's learned scores, as a command line:
``python -m evaluation.studies.tune_learned`` (its docstring says more)."""

from evaluation.studies.tune_learned import main

if __name__ == "__main__":
    main()
