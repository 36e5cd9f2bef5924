"""How often the needle's answer tokens survive eviction, as a command line: ``python -m
evaluation.studies.snis_needle_coverage`` (its docstring says more)."""

from evaluation.studies.snis_needle_coverage import main

if __name__ == "__main__":
    main()
