"""The uncompressed model's accuracy on the key-value set, as a command line: ``python -m
evaluation.studies.keyfacts_full_accuracy`` (its docstring says more)."""

from evaluation.studies.keyfacts_full_accuracy import main

if __name__ == "__main__":
    raise SystemExit(main())
