"""The search for Page-EntroKV's defaults, as a command line: ``python -m evaluation.studies.tune_page_entrokv`` (its
docstring says more)."""

from evaluation.studies.tune_page_entrokv import main

if __name__ == "__main__":
    main()
