"""Paired comparisons of one press against others from committed runs, as a command line:
``python -m evaluation.studies.paired`` (its docstring says more)."""

import sys

from evaluation.studies.paired import main

if __name__ == "__main__":
    sys.exit(main())
