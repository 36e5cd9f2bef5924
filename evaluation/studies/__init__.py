"""The studies and benchmarks behind ``results/``: each module does one study, runs as
``python -m evaluation.studies.<name>`` (``scripts/<name>.py`` is the same command line) and writes its artifacts
with the command that produced them. Analysis, not library: nothing under ``presses/`` imports it.

- ``claims_ledger``: every claim of the three papers beside this project's counterpart (``results/claims.md``);
- ``needle_group``: paper 000 Table 10's synthetic needle group (the ledger's Table 10 rows).
"""

from pathlib import Path

#: the checkout whose ``results/``, ``configs/`` and ``runs/`` the studies read and write by default
REPO = Path(__file__).resolve().parents[2]
