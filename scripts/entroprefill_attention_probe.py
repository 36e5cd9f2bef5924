"""The attention probe of EntroPrefill's position bias, as a command line: ``python -m
evaluation.studies.entroprefill_attention_probe`` (its docstring says more)."""

from evaluation.studies.entroprefill_attention_probe import main

if __name__ == "__main__":
    raise SystemExit(main())
