"""CPython's own standard library as offline real text: the running interpreter's ``.py`` sources and its bundled
documentation (``pydoc_data.topics``), with a fixed development / test split.

Licence: the Python Software Foundation License v2 (CPython's sources and documentation). Nothing is downloaded:
every interpreter carries this text. The text is the running interpreter's, so the sets built on it
(:mod:`evaluation.datasets.stdlib_code`, :mod:`evaluation.datasets.stdlib_docs`,
:mod:`evaluation.datasets.continuation_loss`) are tied to its version: each example records
:func:`interpreter_metadata`, and two interpreters of the same version give the same examples (CI and the
project's machines run the same Python).

Which files count (:func:`source_files`): every ``.py`` file below ``sysconfig``'s ``stdlib`` directory, sorted,
except those below a directory of :data:`EXCLUDED_DIRS` (third-party packages, CPython's own test suite and the
test packages inside other packages, whose files include deliberately malformed code and data; the generated
codec tables of ``encodings``; ``pydoc_data``, the documentation itself) or a ``config-*`` build directory,
and files that are not UTF-8.

The split (:func:`split_of`) is by top-level module or package: a fixed hash (SHA-256) of its name puts it in
``dev`` (:data:`DEV_PERCENT` percent of names) or ``test``; a documentation topic is split by its own name the
same way. So the two splits hold disjoint files, a package never straddles them, and a new file in a later
Python joins its package's split without moving any other.
"""

from __future__ import annotations

import array
import bisect
import functools
import hashlib
import platform
import sysconfig
from pathlib import Path

from evaluation.datasets.tokens import count_tokens

__all__ = [
    "SPLITS",
    "DEV_PERCENT",
    "EXCLUDED_DIRS",
    "LICENCE",
    "MIN_FILL",
    "stdlib_root",
    "interpreter_metadata",
    "source_files",
    "read_source",
    "unit_of",
    "split_of",
    "check_split",
    "check_set",
    "examples_per_cell",
    "first_examples",
    "files_in_split",
    "topics_in_split",
    "topic_text",
    "largest_prefix",
    "shrink_to_fit",
    "LineTokens",
    "file_lines",
    "topic_lines",
]

SPLITS = ("dev", "test")
#: percent of top-level names (and documentation topics) in the development split
DEV_PERCENT = 25
#: directories whose files are never used (anywhere below the stdlib root)
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__phello__"}
)
LICENCE = "Python Software Foundation License v2 (CPython sources and documentation)"
#: a prompt shorter than this fraction of its target length is not used (its text is too short)
MIN_FILL = 0.9


def stdlib_root() -> Path:
    """The running interpreter's standard library directory (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def interpreter_metadata() -> dict:
    """What the text depends on, for each example's metadata: the Python version and the stdlib directory."""
    return {"python_version": platform.python_version(), "stdlib": str(stdlib_root())}


@functools.lru_cache(maxsize=1)
def source_files() -> tuple[str, ...]:
    """Relative POSIX paths of the usable ``.py`` files (see the module docstring), sorted."""
    root = stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        try:
            path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.append(rel.as_posix())
    return tuple(sorted(out))


@functools.lru_cache(maxsize=256)
def read_source(relpath: str) -> str:
    """The text of one stdlib file (``relpath`` as :func:`source_files` gives it), newlines normalised to ``\\n``."""
    return (stdlib_root() / relpath).read_text(encoding="utf-8").replace("\r\n", "\n")


def unit_of(relpath: str) -> str:
    """The top-level module or package a file belongs to (``json/decoder.py`` -> ``json``, ``abc.py`` -> ``abc``)."""
    first = relpath.split("/", 1)[0]
    return first.removesuffix(".py")


def split_of(name: str) -> str:
    """``"dev"`` or ``"test"`` for a top-level name or a documentation topic (a fixed hash of the name)."""
    digest = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")
    return "dev" if digest % 100 < DEV_PERCENT else "test"


def check_split(split: str) -> str:
    """Return ``split``.

    Raises:
        ValueError: unless it is one of :data:`SPLITS`.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    return split


def check_set(name: str, tasks, known, split: str, context_lengths, min_length: int, why: str = "") -> list[str]:
    """Check the parameters every set built on the standard library shares; return ``tasks`` as strings.

    Raises:
        ValueError: a task not in ``known``, an unknown split, or a length below ``min_length`` tokens (``why``:
            what sets that minimum).
    """
    tasks = [str(t) for t in tasks]
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise ValueError(f"unknown {name} tasks {unknown}; known: {list(known)}")
    check_split(split)
    short = [n for n in context_lengths if int(n) < min_length]
    if short:
        raise ValueError(f"context_lengths {short} must be >= {min_length} tokens{f' ({why})' if why else ''}")
    return tasks


def examples_per_cell(n_samples, default: int) -> int:
    """The examples per task and length: ``n_samples``, or ``default`` when it is None.

    Raises:
        ValueError: fewer than 1.
    """
    n = default if n_samples is None else int(n_samples)
    if n < 1:
        raise ValueError(f"n_samples={n} must be >= 1 (examples per task and length)")
    return n


def first_examples(candidates, n: int, build, what: str) -> list:
    """The examples of the first candidates that give one, ``n`` of them, built in order (``build(candidate, i)``:
    example ``i`` or None), so a smaller ``n`` gives a prefix of a larger one.

    Raises:
        ValueError: fewer than ``n`` candidates give an example (``what`` names the split, task and length).
    """
    made = []
    for candidate in candidates:
        if len(made) == n:
            break
        ex = build(candidate, len(made))
        if ex is not None:
            made.append(ex)
    if len(made) < n:
        raise ValueError(f"n_samples={n} is more than {what}: {len(made)} qualify; use n_samples<={len(made)}")
    return made


def files_in_split(split: str) -> list[str]:
    """The usable files whose top-level module or package is in ``split``, sorted.

    Raises:
        ValueError: an unknown split.
    """
    check_split(split)
    return [f for f in source_files() if split_of(unit_of(f)) == split]


def topics_in_split(split: str) -> list[str]:
    """The ``pydoc_data.topics`` topic names in ``split``, sorted.

    Raises:
        ValueError: an unknown split.
    """
    from pydoc_data import topics

    check_split(split)
    return [t for t in sorted(topics.topics) if split_of(t) == split]


def topic_text(topic: str) -> str:
    """The text of one documentation topic (``pydoc_data.topics``)."""
    from pydoc_data import topics

    return topics.topics[topic]


def largest_prefix(n: int, fits, allowed=None) -> int:
    """The largest ``j`` in ``0..n`` such that ``fits(j)`` holds and ``allowed`` accepts it; 0 when none does.

    ``fits(j)`` must be monotone (true up to some ``j``, false after: the token count of the first ``j`` lines of
    a text within a budget; ``fits(0)`` is taken as true). It is found by doubling ``j``, then bisecting, so a
    budget check tokenises about ``2 log2(j)`` prefixes, none much longer than the answer's. Then the largest
    allowed ``j`` at or below it is returned.

    Args:
        n: the number of lines (or other units) to choose among.
        fits: ``j -> bool``, whether the first ``j`` fit.
        allowed: ``j -> bool`` (default: every ``j``), e.g. "line ``j`` may be the answer".
    """
    lo, step = 0, 1
    while lo + step <= n and fits(lo + step):  # lo fits; double the step while the next probe fits
        lo, step = lo + step, 2 * step
    hi = min(n, lo + step - 1)  # lo + step does not fit (or lies beyond n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    j = lo
    while j > 0 and allowed is not None and not allowed(j):
        j -= 1
    return j


def shrink_to_fit(j: int, tokens, limit: int, allowed=None) -> int:
    """Walk ``j`` down (to the previous allowed value) while ``tokens(j)``, an exact count, exceeds ``limit``;
    0 when nothing above 0 fits. Used after :func:`largest_prefix` on estimated counts (:class:`LineTokens`)."""
    while j > 0 and tokens(j) > limit:
        j -= 1
        while j > 0 and allowed is not None and not allowed(j):
            j -= 1
    return j


class LineTokens:
    """Estimated token counts of runs of whole lines of one text, from a single tokenisation.

    The text is tokenised once (a fast tokenizer's offset mapping); the tokens of lines ``a..b-1`` are those
    that start inside them. Exact but at the seams: a token that spans a line break (``"\\n" + indentation``)
    counts for the line it starts in, and a run tokenised on its own may merge or split one token at each end.
    Without a fast tokenizer each line is counted alone (which overcounts merges across lines). Callers check
    the final prompt exactly (:func:`shrink_to_fit`).

    Attributes:
        lines: the text's lines with their newlines.
    """

    def __init__(self, tokenizer, text: str):
        self.lines = text.splitlines(keepends=True)
        self._line_starts = [0]
        for line in self.lines:
            self._line_starts.append(self._line_starts[-1] + len(line))
        if getattr(tokenizer, "is_fast", False):
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
            self._token_starts = array.array("q", (int(start) for start, _ in enc["offset_mapping"]))
            self._cumulative = None
        else:
            counts = [count_tokens(tokenizer, line) for line in self.lines]
            self._cumulative = [0]
            for c in counts:
                self._cumulative.append(self._cumulative[-1] + c)

    def count(self, a: int, b: int) -> int:
        """Estimated tokens of ``lines[a:b]`` (``0 <= a <= b <= len(lines)``)."""
        if self._cumulative is not None:
            return self._cumulative[b] - self._cumulative[a]
        starts = self._token_starts
        return bisect.bisect_left(starts, self._line_starts[b]) - bisect.bisect_left(starts, self._line_starts[a])


@functools.lru_cache(maxsize=2048)
def file_lines(tokenizer, relpath: str) -> LineTokens:
    """:class:`LineTokens` of one stdlib file (memoised per tokenizer and file)."""
    return LineTokens(tokenizer, read_source(relpath))


@functools.lru_cache(maxsize=512)
def topic_lines(tokenizer, topic: str) -> LineTokens:
    """:class:`LineTokens` of one documentation topic (memoised per tokenizer and topic)."""
    return LineTokens(tokenizer, topic_text(topic))
