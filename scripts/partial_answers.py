"""How wrong number answers are wrong (whole, digits dropped, other) in committed runs, as a command line:
``python -m evaluation.studies.partial_answers`` (its docstring says more)."""

import sys

from evaluation.studies.partial_answers import main

if __name__ == "__main__":
    sys.exit(main())
