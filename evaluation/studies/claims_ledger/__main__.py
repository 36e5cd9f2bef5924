"""``python -m evaluation.studies.claims_ledger``: writes ``results/claims.md`` (:func:`.render.main`)."""

from evaluation.studies.claims_ledger.render import main

if __name__ == "__main__":
    main()
