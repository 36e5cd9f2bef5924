"""``python -m evaluation.train_scorers <command>``: see :mod:`evaluation.train_scorers`."""

from evaluation.train_scorers.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
