"""A Triton kernel cache of this process's own (issue 32 item 10).

Triton compiles each kernel once per configuration and keeps the binary in ``TRITON_CACHE_DIR`` (default
``~/.triton/cache``). Parallel workers that share the directory (Hydra's joblib launcher, ``pytest -n``, the shards
of a grid, SLURM jobs on one node) write and read the same entries concurrently; mixed entries have given silent
NaNs elsewhere (triton #2688, PR #11319). :func:`use_process_cache` points this process at a fresh directory of its
own, removed when the process exits; the harness's per-example loop (every parallel path of ``evaluation.run`` and
``evaluation.fused``) and the test suite's workers call it before a kernel compiles. Triton reads
``TRITON_CACHE_DIR`` at every compilation, so it applies even after Triton was imported. A directory the user chose
(``TRITON_CACHE_DIR`` set outside this module) is kept.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

__all__ = ["OWNER", "use_process_cache"]

#: The environment variable naming the process that set ``TRITON_CACHE_DIR`` through :func:`use_process_cache`
#: (children inherit both: a child sees another owner and takes a directory of its own).
OWNER = "KVPRESS_RESEARCH_TRITON_CACHE_OWNER"


def use_process_cache() -> str:
    """Point Triton's cache at a directory of this process's own (created, and removed at exit), unless the user set
    ``TRITON_CACHE_DIR`` or this process already did.

    Returns:
        The cache directory in use.
    """
    current = os.environ.get("TRITON_CACHE_DIR")
    owner = os.environ.get(OWNER)
    if current and (owner is None or owner == str(os.getpid())):  # the user's choice, or ours already
        return current
    path = tempfile.mkdtemp(prefix=f"kvpress-research-triton-{os.getpid()}-")
    atexit.register(shutil.rmtree, path, True)
    os.environ["TRITON_CACHE_DIR"] = path
    os.environ[OWNER] = str(os.getpid())
    return path
