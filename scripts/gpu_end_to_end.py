"""The GPU check's end-to-end stage, as a command line: ``python -m evaluation.studies.gpu_end_to_end`` (its
docstring says more)."""

from evaluation.studies.gpu_end_to_end import main

if __name__ == "__main__":
    raise SystemExit(main())
