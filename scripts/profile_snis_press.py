"""Where the probabilistic-eviction press spends its prefill time, as a command line: ``python -m
evaluation.studies.profile_snis_press`` (its docstring says more)."""

from evaluation.studies.profile_snis_press import main

if __name__ == "__main__":
    main()
