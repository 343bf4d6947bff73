"""What the paper's scripts share: the machine's name, a median with its spread, matplotlib."""
from __future__ import annotations

import statistics


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def spread(xs, digits: int = 2) -> str:
    """``median (min..max)``: a figure over rounds with its per-round spread."""
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}..{max(xs):.{digits}f})"


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only), or None, said, when it is not
    installed (a perf-only dependency: ``pip install matplotlib``)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib is not installed (pip install matplotlib): no plot", flush=True)
        return None
    return plt


def save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"# plot: {path}", flush=True)
