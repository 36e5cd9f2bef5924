"""The speed and memory benchmark's command line: ``python -m evaluation.studies.bench_speed_memory`` (its docstring
says more; Hydra overrides as arguments)."""

from evaluation.studies.bench_speed_memory.sweep import main

if __name__ == "__main__":
    main()
