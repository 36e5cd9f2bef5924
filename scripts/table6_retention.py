"""Paper 000's Table 6 and Fig. 9b on the embedded model, as a command line: ``python -m
evaluation.studies.table6_retention`` (its docstring says more)."""

from evaluation.studies.table6_retention import main

if __name__ == "__main__":
    main()
