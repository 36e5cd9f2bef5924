"""The GPU check's report, as a command line: ``python -m evaluation.studies.gpu_report`` (its docstring says more)."""

from evaluation.studies.gpu_report import main

if __name__ == "__main__":
    raise SystemExit(main())
