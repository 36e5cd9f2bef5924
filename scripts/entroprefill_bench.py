"""EntroPrefill against the full prefill, as a command line: ``python -m evaluation.studies.entroprefill_bench`` (its
docstring says more)."""

from evaluation.studies.entroprefill_bench import main

if __name__ == "__main__":
    raise SystemExit(main())
