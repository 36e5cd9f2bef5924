"""Answers on the page grid against committed scores, as a command line: ``python -m evaluation.studies.page_straddle``
(its docstring says more)."""

import sys

from evaluation.studies.page_straddle import main

if __name__ == "__main__":
    sys.exit(main())
