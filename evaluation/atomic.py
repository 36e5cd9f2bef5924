"""Every result file is written whole or not at all: into a temporary file beside it, then ``os.replace``.

Standard library only (a figure is rendered by its own ``savefig``): the GPU check's scripts import this module on
a machine that may lack the project's dependencies (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

__all__ = ["save_figure", "write_atomic"]


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text, UTF-8, or bytes) to ``path`` through a temporary file and ``os.replace``: a reader sees
    the old file or the new one, never half of one, and a run killed mid-write leaves only a hidden ``.tmp`` file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_figure(fig, path: Path, dpi: int) -> None:
    """Save the matplotlib figure ``fig`` as a PNG of ``dpi`` dots per inch at ``path`` (atomically,
    :func:`write_atomic`), then close it."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    write_atomic(path, buf.getvalue())
