"""qlinear's automatic choices (paths -1, -2) by measured speed: a short calibration at start-up.

`resolve_path` (csrc/cpu/qlinear.cpp) has a rule for which kernel an automatic choice takes,
written from micro-benchmarks on one CPU. `ensure` replaces it, on the CPU it runs on, by what
it measures there:

* **What is timed.** Every path an automatic choice may take on this CPU
  (``torch.ops.symphony.qlinear_auto_paths``: for -1 the float32 register kernels, the 15-bit
  kernels and the dense GEMM; for -2 the int8-activation kernels and the dense GEMM), forced,
  on one ``[1536, 576]`` weight per kind (u4, i8; random but seeded), at the row count that
  stands for each bucket of rows (`BUCKETS`, from the rule's own thresholds: 1 row, 2-3, 4-31,
  32-63, 64 and more, timed at 1, 2, 8, 48 and 128 rows: the kernel's prefill chunk), with the calling
  thread's torch thread count. Each time is the median of `REPS` repetitions (the paths
  interleaved), each a fixed number of calls. A path more than `PRUNE` times slower than the
  fastest at a bucket is not timed at the larger ones (the dense GEMM excepted: its
  dequantization is a fixed cost that more rows amortize), nor, within a bucket, one whose
  first call was; the rule's choices always are (they are the baselines below). The whole is bounded by `BUDGET_S`; if that runs out, the cells not yet timed
  keep the rule's choice and the result is not cached either.
* **The choice.** Per (mode, kind, bucket) the path the mode may take with the lowest median,
  if it beats the rule's choice by more than `MARGIN` and each of its repetitions was faster
  than each of the rule's (with 5 interleaved repetitions a tie passes that by chance once in
  252); otherwise the rule's: noise does not move a choice. A measurement where, the fastest
  and the slowest repetition of a path set aside, the others still differ by more than
  `UNSTEADY` times (another process took the cores) is used so, but not cached: the next start
  measures again.
* **Where it goes.** `torch.ops.symphony.qlinear_set_auto`: a table in the ops library that
  qlinear's automatic choices read, so that ``QWeight.linear`` and the layer-stack op
  ``llama_layers`` (which passes -1 / -2 through) take the same kernels;
  ``ops.qlinear_path_for`` reports them.
* **Cache.** ``qlinear-calibration-<threads>t.json`` in the ops build directory, keyed by the
  CPU (model name, vendor, family, model, stepping, a hash of its flags), the thread count, the
  ops build (`build.build_hash`) and this module's plan (shape, buckets, repetitions). A cache
  that is unreadable or corrupt, whose key is another's, or whose choices name a path this CPU
  cannot take, is ignored with one log line and the CPU calibrated again. Written atomically
  (a temporary file renamed over it).
* **Control.** ``SYMPHONY_QLINEAR_CALIBRATION``: ``auto`` (default: the cache, else calibrate),
  ``force`` (calibrate and rewrite the cache), ``off`` (the rule of resolve_path, as before).

`ensure` logs one line (logger ``symphony.ops``): each choice, and whether it came from the
cache or a fresh calibration (with its time), or that calibration is off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from . import build

logger = logging.getLogger("symphony.ops")

ENV = "SYMPHONY_QLINEAR_CALIBRATION"
SETTINGS = ("auto", "force", "off")
MODES = (-1, -2)                        # float-accurate, int8 activations
KINDS = (0, 1)                          # u4, i8 (csrc/quant.h)
KIND_NAMES = {0: "u4", 1: "i8"}
DENSE = 3
# (first row of the bucket, rows timed for it, calls a repetition)
BUCKETS = ((1, 1, 8), (2, 2, 8), (4, 8, 4), (32, 48, 1), (64, 128, 1))
SHAPE = (1536, 576)                     # [N, K] of the weights timed
REPS = 5
PRUNE = 3.0
MARGIN = 0.05
UNSTEADY = 1.25
BUDGET_S = 1.5
VERSION = 1


@dataclasses.dataclass
class Calibration:
    """qlinear's automatic choices: ``choices[(mode, kind)]`` one path per bucket (``rows``: the
    buckets' first rows); ``times[(kind, rows timed, path)]`` the median seconds a call measured
    (empty when read from a cache written without them); ``source`` "calibrated", "cache",
    "off" or "failed" (the last two: the rule, no choices); ``complete`` whether every cell was timed, ``steady``
    whether the timings were steady (`UNSTEADY`; both: cacheable)."""

    rows: tuple[int, ...]
    choices: dict[tuple[int, int], list[int]]
    times: dict[tuple[int, int, int], float]
    source: str
    complete: bool = True
    steady: bool = True
    seconds: float = 0.0
    cache: Optional[Path] = None

    def describe(self) -> str:
        """The choices as one line: ``-1 u4: 1 12, 2-3 12, 4-31 11, ...; ...``."""
        if not self.choices:
            why = f"{ENV}=off" if self.source == "off" else "it failed"
            return f"qlinear calibration off ({why}): the built-in rule of csrc/cpu/qlinear.cpp"
        spans = [f"{a}-{b - 1}" if b - 1 > a else f"{a}" for a, b in zip(self.rows, self.rows[1:])]
        spans.append(f"{self.rows[-1]}+")
        cells = "; ".join(f"{mode} {KIND_NAMES[kind]}: " + ", ".join(
            f"{s} {p}" for s, p in zip(spans, self.choices[(mode, kind)]))
            for mode in MODES for kind in KINDS)
        how = (f"calibrated in {self.seconds:.2f} s" if self.source == "calibrated"
               else f"from the cache {self.cache}")
        if not self.complete:
            how += f", budget of {BUDGET_S} s spent: cells not timed keep the rule's choice, not cached"
        elif not self.steady:
            how += ", unsteady timings (a busy CPU?): not cached"
        return f"qlinear paths by rows ({how}): {cells}"


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def setting() -> str:
    """``$SYMPHONY_QLINEAR_CALIBRATION``: auto (also when unset), force or off; ValueError
    naming the variable for anything else."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in SETTINGS:
        raise ValueError(f"{ENV} must be one of {', '.join(SETTINGS)}, got {value!r}")
    return value


def ensure_for(device: torch.device, quantized: bool) -> Optional[Calibration]:
    """`ensure` for a model on ``device`` whose weights are ``quantized`` or not: only quantized
    weights on the CPU take qlinear's automatic choices; None otherwise."""
    return ensure() if device.type == "cpu" and quantized else None


def ensure() -> Calibration:
    """Install qlinear's automatic choices for this CPU and the calling thread's torch thread
    count (call it on the thread that runs the model), as `setting` says, and log them. Once
    per process, setting and thread count: later calls return the same `Calibration` without
    measuring or logging. ValueError for an unknown setting. A calibration that fails (an op
    raising) is logged and leaves the rule."""
    from . import load
    mode = setting()
    load()
    threads = torch.get_num_threads()
    with _lock:
        done = _installed.get((mode, threads))
        if done is not None:
            return done
        clear()                                  # the rule, while measuring and if off
        calib = Calibration((), {}, {}, "off")
        if mode != "off":
            path, key = cache_path(threads), cache_key(threads)
            try:
                calib = (read_cache(path, key) if mode == "auto" else None) or measure()
            except RuntimeError as e:
                logger.warning("qlinear calibration failed (%s): the built-in rule decides", e)
                calib = Calibration((), {}, {}, "failed")
            if calib.source == "calibrated" and calib.complete and calib.steady:
                calib.cache = write_cache(path, key, calib)
            install(calib)
        logger.info("%s", calib.describe())
        _installed.clear()
        _installed[(mode, threads)] = calib
        return calib


def measure(budget_s: float = BUDGET_S) -> Calibration:
    """Time the paths (module docstring) and pick the fastest per mode, kind and bucket; the
    ops' table must hold no choices meanwhile (`clear`), as the rule fills untimed cells."""
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    allowed = {mode: auto_paths(mode) for mode in MODES}
    candidates = sorted(set().union(*allowed.values()))
    gen = torch.Generator().manual_seed(0)
    samples: dict[tuple[int, int, int], list[float]] = {}     # (kind, rows, path) -> seconds a call
    complete = True
    for kind in KINDS:
        w = _weight(kind, gen)
        alive = list(candidates)
        for _, m, calls in BUCKETS:
            x = torch.randn(m, SHAPE[1], generator=gen)       # [M, K]
            rules = {_rule(mode, m, kind) for mode in MODES}  # always timed: the baselines
            got = _time_paths(x, w, kind, [p for p in candidates if p in alive or p in rules],
                              rules, calls, deadline)
            if got is None:
                complete = False
                continue
            samples.update({(kind, m, p): s for p, s in got.items()})
            best = min(statistics.median(s) for s in got.values())
            alive = [p for p in alive
                     if p == DENSE or (p in got and statistics.median(got[p]) <= PRUNE * best)]
    choices = {(mode, kind): [_choose(mode, kind, m, allowed[mode], samples) for _, m, _ in BUCKETS]
               for mode in MODES for kind in KINDS}
    steady = all(sorted(s)[-2] <= UNSTEADY * sorted(s)[1] for s in samples.values())
    times = {c: statistics.median(s) for c, s in samples.items()}
    return Calibration(tuple(b[0] for b in BUCKETS), choices, times, "calibrated", complete,
                       steady, time.perf_counter() - t0)


def install(calib: Calibration) -> None:
    """Hand the choices to the ops library (an "off" or "failed" one clears them: the rule)."""
    if not calib.choices:
        clear()
        return
    flat = [p for mode in MODES for kind in KINDS for p in calib.choices[(mode, kind)]]
    torch.ops.symphony.qlinear_set_auto(list(calib.rows), flat)


def clear() -> None:
    """No measured choices in the ops library: the rule of resolve_path decides."""
    torch.ops.symphony.qlinear_set_auto([], [])
    _installed.clear()


def auto_paths(mode: int) -> list[int]:
    """The paths the automatic choice ``mode`` (-1, -2) may take on this CPU."""
    return [int(p) for p in torch.ops.symphony.qlinear_auto_paths(int(mode))]


def cache_path(threads: int) -> Path:
    """The cache file for ``threads`` torch threads, in the loaded ops' build directory."""
    loaded = build.loaded_build
    if loaded is None:
        raise RuntimeError("symphony: the ops are not loaded yet (ops.load())")
    return loaded[0] / f"qlinear-calibration-{threads}t.json"


def cache_key(threads: int) -> dict:
    """What a cached calibration is valid for: this CPU, ``threads``, this ops build and this
    module's plan."""
    loaded = build.loaded_build
    return {"version": VERSION, "cpu": cpu_identity(), "threads": threads,
            "build": loaded[1] if loaded else None,
            "plan": {"shape": list(SHAPE), "buckets": [list(b) for b in BUCKETS], "reps": REPS,
                     "prune": PRUNE, "margin": MARGIN}}


def cpu_identity() -> dict:
    """The CPU's model name, vendor, family, model, stepping and a hash of its flags (Linux's
    /proc/cpuinfo, first processor; elsewhere what `platform` says)."""
    want = {"model name": "model_name", "vendor_id": "vendor", "cpu family": "family",
            "model": "model", "stepping": "stepping", "flags": "flags", "features": "flags"}
    out = {"machine": platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break                                     # the first processor's block
                k, _, v = line.partition(":")
                name = want.get(k.strip().lower())
                if name:
                    out[name] = v.strip()
    except OSError:
        out["model_name"] = platform.processor()
    if "flags" in out:
        out["flags"] = hashlib.sha256(" ".join(sorted(out["flags"].split())).encode()).hexdigest()[:16]
    return out


def read_cache(path: Path, key: dict) -> Optional[Calibration]:
    """The calibration cached at ``path`` if it is whole, for ``key`` and possible on this CPU;
    otherwise None, with one log line saying why (none for a missing file)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("qlinear calibration cache %s is unreadable or corrupt (%s): ignored, "
                       "calibrating again", path, e)
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        logger.warning("qlinear calibration cache %s was written for another CPU, thread count, "
                       "ops build or plan: ignored, calibrating again", path)
        return None
    try:
        rows = tuple(int(r) for r in data["rows"])
        if rows != tuple(b[0] for b in BUCKETS):
            raise ValueError(f"buckets {rows}")
        choices = {(mode, kind): [int(p) for p in data["choices"][str(mode)][str(kind)]]
                   for mode in MODES for kind in KINDS}
        if any(len(c) != len(rows) for c in choices.values()):
            raise ValueError("a choice per bucket expected")
        times = {(int(k), int(m), int(p)): float(t)
                 for k, by_m in data.get("times_s", {}).items()
                 for m, by_p in by_m.items() for p, t in by_p.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        logger.warning("qlinear calibration cache %s is corrupt (%s): ignored, calibrating again",
                       path, e)
        return None
    for mode in MODES:
        allowed = auto_paths(mode)
        bad = sorted({p for kind in KINDS for p in choices[(mode, kind)] if p not in allowed})
        if bad:
            logger.warning("qlinear calibration cache %s names path(s) %s, which the automatic "
                           "choice %d cannot take on this CPU: ignored, calibrating again",
                           path, bad, mode)
            return None
    return Calibration(rows, choices, times, "cache", cache=path)


def write_cache(path: Path, key: dict, calib: Calibration) -> Optional[Path]:
    """Write ``calib`` to ``path`` atomically; the path, or None (logged) if it cannot be."""
    times: dict = {}
    for (kind, m, p), t in sorted(calib.times.items()):
        times.setdefault(str(kind), {}).setdefault(str(m), {})[str(p)] = t
    data = {"key": key, "rows": list(calib.rows),
            "choices": {str(mode): {str(kind): calib.choices[(mode, kind)] for kind in KINDS}
                        for mode in MODES},
            "times_s": times}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("qlinear calibration: cannot write the cache %s (%s); calibrating again "
                       "at the next start", path, e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return None
    return path


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
_lock = threading.Lock()
_installed: dict[tuple[str, int], Calibration] = {}


def _weight(kind: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A random quantized ``SHAPE`` weight of ``kind``, groups of 32: (qs, scales, mins, group)."""
    n, k = SHAPE
    scales = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001     # [N, K/32]
    if kind == 0:
        qs = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        mins = -8 * scales
    else:
        qs = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        mins = torch.empty(0)
    return qs, scales, mins, 32


def _time_paths(x: torch.Tensor, w, kind: int, paths: list[int], keep: set[int], calls: int,
                deadline: float) -> Optional[dict[int, list[float]]]:
    """The seconds a call of each path on x took, `REPS` repetitions (leaving out paths not in
    ``keep`` whose first call took more than `PRUNE` times the fastest first call), or None if
    the deadline passed first."""
    qs, scales, mins, group = w
    op = torch.ops.symphony.qlinear

    def run(p: int) -> float:
        t = time.perf_counter()
        for _ in range(calls):
            op(x, qs, scales, mins, kind, group, p)
        return (time.perf_counter() - t) / calls

    first: dict[int, float] = {}
    for p in paths:
        if time.perf_counter() > deadline:
            return None
        first[p] = run(p)
    quick = min(first.values())
    timed = [p for p in paths if p in keep or first[p] <= PRUNE * quick]
    samples: dict[int, list[float]] = {p: [] for p in timed}
    for _ in range(REPS):
        if time.perf_counter() > deadline:
            return None
        for p in timed:                                        # interleaved: drift hits all alike
            samples[p].append(run(p))
    return samples


def _choose(mode: int, kind: int, m: int, allowed: list[int],
            samples: dict[tuple[int, int, int], list[float]]) -> int:
    """The path ``mode`` takes at ``m`` rows: the timed one with the lowest median if it beats
    the rule's choice clearly (module docstring), else the rule's."""
    rule = _rule(mode, m, kind)
    timed = {p: samples[(kind, m, p)] for p in allowed if (kind, m, p) in samples}
    if not timed:
        return rule
    med = {p: statistics.median(s) for p, s in timed.items()}
    best = min(med, key=lambda p: (med[p], p))
    if rule not in timed:                       # (not timed: the budget ran out)
        return rule
    if med[best] * (1 + MARGIN) < med[rule] and max(timed[best]) < min(timed[rule]):
        return best
    return rule


def _rule(mode: int, m: int, kind: int) -> int:
    """The rule's choice (resolve_path with no table) for ``m`` rows of the timed shape."""
    from . import qlinear_path_for
    return qlinear_path_for(mode, m, SHAPE[0], SHAPE[1], kind)
