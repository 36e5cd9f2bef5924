"""The claims ledger's command line: ``python -m evaluation.studies.claims_ledger`` (its docstring says more)."""

from evaluation.studies.claims_ledger.render import main

if __name__ == "__main__":
    main()
