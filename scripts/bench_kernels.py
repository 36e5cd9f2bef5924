"""The kernel benchmark, as a command line: ``python -m evaluation.studies.bench_kernels`` (its docstring says more)."""

from evaluation.studies.bench_kernels import main

if __name__ == "__main__":
    raise SystemExit(main())
