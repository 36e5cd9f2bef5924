"""``python -m evaluation.studies.bench_speed_memory``: the Hydra entry point (:func:`.sweep.main`)."""

from evaluation.studies.bench_speed_memory.sweep import main

if __name__ == "__main__":
    main()
