"""KVzip's exact scores at a lower cost against kvpress's KVzip, as a command line:
``python -m evaluation.studies.kvzip_fast`` (its docstring says more)."""

from evaluation.studies.kvzip_fast import cli

if __name__ == "__main__":
    cli()
