"""The claims ledger: every claim of the three source papers beside this project's counterpart.

Usage (``python -m evaluation.studies.claims_ledger`` is the same)::

    python scripts/claims_ledger.py                      # reads results/claims/claims.yaml, writes results/claims.md
    python scripts/claims_ledger.py --out /tmp/claims.md  # somewhere else

``results/claims/claims.yaml`` is the hand-curated source: for every claim its paper, section or table, the claim,
the paper's number and setting, and one or more pointers to our counterpart. The ledger never types a number of
ours: it reads every measured number from the committed artifact the pointer names (a CSV row filter and column,
a JSON key, a JSONL field, or a function of :mod:`.derived` that reads the artifact) and computes the analytic
ones with the project's own code (:mod:`.analytic`). A pointer whose artifact does not exist (yet) is reported as
"not measured yet" with the command that would produce it, never as an error; the next pointer of the claim is tried
first.

Pointer kinds (``ours:`` is a list; the first one whose artifact exists is used):

- ``csv``: ``file``, ``filter`` ({column: value or [values]}), ``column``, ``agg`` (first, mean, median, max, min,
  sum, count, frac_true, all_true), ``scale``, ``fmt``; or ``values``: a list of such parts, each with a ``label``
  and its own ``filter`` (merged over the pointer's) / ``column`` / ``agg`` / ``fmt``.
- ``json``: ``file``, ``key`` (dotted path) or ``values``.
- ``jsonl``: ``files`` (a glob), ``field`` (dotted path), ``agg``.
- ``derived``: ``fn`` (a name in :data:`.derived.DERIVED`), ``args``; reads committed artifacts, may say whether the
  claim holds.
- ``analytic``: ``fn`` (a name in :data:`.analytic.ANALYTIC`), ``args``; exact computation with the project's code.
- ``test``: ``file``, ``name``: a property test that checks the claim on synthetic inputs (not run here; its
  existence is checked).
- ``none``: ``reason`` and optionally ``needs`` (a larger model, a GPU, data): no counterpart here.

Every pointer carries ``setting`` and ``command`` (how the artifact was or would be produced); ``check``
(``{op: <=|>=|==|approx|between, value, tol, lo, hi, part}``) turns the number into a yes/no "agrees" column.

Modules: :mod:`.artifacts` (reading the artifacts), :mod:`.pointers` (the pointer language), :mod:`.derived` and
:mod:`.analytic` (the pointer functions), :mod:`.render` (validation, the Markdown, the command line).
"""
