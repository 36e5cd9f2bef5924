"""The row-kernel sweep, as a command line: ``python -m evaluation.studies.tune_row_masses`` (its docstring says
more)."""

from evaluation.studies.tune_row_masses import main

if __name__ == "__main__":
    raise SystemExit(main())
