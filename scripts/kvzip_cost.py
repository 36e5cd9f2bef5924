"""KVzip's cost per example on the embedded model, as a command line: ``python -m evaluation.studies.kvzip_cost``
(its docstring says more)."""

from evaluation.studies.kvzip_cost import cli

if __name__ == "__main__":
    cli()
