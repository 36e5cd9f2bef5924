"""The summary of EntroPrefill's position-bias study, as a command line: ``python -m
evaluation.studies.entroprefill_position_bias_report`` (its docstring says more)."""

from evaluation.studies.entroprefill_position_bias_report import main

if __name__ == "__main__":
    raise SystemExit(main())
