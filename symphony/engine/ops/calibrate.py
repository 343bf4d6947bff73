"""qlinear's automatic choices (paths -1, -2) by measured speed: a short calibration at start-up.

`resolve_path` (csrc/cpu/qlinear.cpp) has a rule for which kernel an automatic choice takes,
written from micro-benchmarks on one CPU. `ensure` replaces it by what it measures on the CPU
it runs on: never worse than the rule's choice, and the fastest where the rule is wrong:

* **What is timed.** Every path an automatic choice may take on this CPU
  (``torch.ops.symphony.qlinear_auto_paths``: for -1 the float32 register kernels, the 15-bit
  kernels and the dense GEMM; for -2 the int8-activation kernels and the dense GEMMs, float32
  and bfloat16), forced, on a ``[1536, 576]`` weight per kind (u4, i8; float16 scales as Q4_1 /
  Q8_0 keep them; random but seeded; `COPIES` of it called in turn, so that, as in a decode
  step, a call does not find its weight in the core's caches), at the row count of each bucket of
  rows (`BUCKETS`, from the rule's thresholds: 1 row, 2-3, 4-15, 16-31, 32-63, 64-127, 128-255,
  256 and more, timed at 1, 2, 8, 24, 48, 96, 128 and 512 rows: 16-31 apart from 4-15, where the
  15-bit tiles overtake the float kernel), with the calling thread's torch thread count.
* **How, on a busy CPU** (`timing.interleaved`). The paths of a bucket are timed in
  interleaved rounds (one sample of each path a round, in a new order each round; a sample is
  several calls at 1-8 rows, and as many times `MIN_CLEAN` samples are kept), each sample the
  CPU time of the calling thread: the time another process held the core is not in it, what
  that cost the kernel (cooled caches) is. With a thread team, a sample in which the team's
  other threads waited for a core more than `CLEAN` of it is set aside (the calling thread
  waited for them at a barrier), and so are outliers (beyond 3 median absolute deviations);
  a path's time is the lower quartile of the rest (another process only adds to a sample:
  a core taken away, caches it cooled; a kernel that keeps a tile in L1 suffers that more
  than one that streams, so on a busy box its median says more about the neighbour than about
  the kernel: 165-301 us against a steady 211-258 for the float kernel at 8 rows, where it
  takes 169 against 209 on a quiet box). Rounds go on until
  every path has `MIN_CLEAN` such samples (at most `MAX_ROUNDS`); a path whose fastest sample
  is more than `PRUNE` times slower than the fastest is dropped from the bucket and larger ones
  (the dense GEMMs excepted: more rows amortize their dequantization); the rule's choices
  never are (they are the baselines below). The whole is bounded by `BUDGET_S` of the calling
  thread's CPU time and `WALL_S` of wall time, each bucket by its share of what is left; a
  bucket not finished keeps the rule's choice. Where a bucket gets too few kept samples with half
  its share: if most of its samples were kept (the share ran out: slow paths at many rows) the
  team goes on in the other half; else the cores are taken, and it and the buckets after it are
  timed at one thread instead (the kernels split rows alike across threads), and a path must
  then beat the rule's by `PROXY_MARGIN`.
* **The choice.** Per (mode, kind, bucket), among the paths the mode may take that beat the
  rule's choice clearly (time more than `MARGIN` lower, and faster in at least `WIN` of all
  pairs of their samples), the one with the lowest time; the rule's choice if none does, or
  if it was not measured: noise does not move a choice, and a path measured slower than the
  rule's is never taken. From 128 rows on (the open-ended range: a GEMM's lead grows with the
  rows) a dense rule choice is left for a path that is not a GEMM only where that path beats the
  rule's at 128 and at 512 rows alike. Each path is first called on every copy (no sample pays
  first touches, or path 13's copy).
* **The box's load.** The CPU time other processes used meanwhile (/proc/stat less this
  process) is recorded. A calibration on a busy box (others above `QUIET_CORES` cores on
  average), with unfinished buckets, or timed at one thread for a team (its cores taken) is
  used, and cached marked provisional: the next start uses it only while the box is still busy,
  and measures again (caching the result) once it is quiet (`timing.box_load` over 0.2 s); a
  team timed at one thread twice running is kept (``retried``).
* **Where it goes.** `torch.ops.symphony.qlinear_set_auto`: a table the automatic choices read
  (``QWeight.linear`` and ``llama_layers`` alike); ``ops.qlinear_path_for`` reports them.
* **Cache.** ``qlinear-calibration-<threads>t.json`` in the ops build directory, keyed by the
  CPU (model name, vendor, family, model, stepping, a hash of its flags), the thread count, the
  ops build (`build.build_hash`) and this module's plan (shape, buckets, thresholds). A cache
  that is unreadable or corrupt, whose key is another's, or whose choices name a path this CPU
  cannot take, is ignored with one log line and the CPU calibrated again. Written atomically.
* **Control.** ``SYMPHONY_QLINEAR_CALIBRATION``: ``auto`` (default: the cache, else calibrate),
  ``force`` (calibrate, rewrite the cache), ``off`` (the rule). `ensure` logs one line (logger
  ``symphony.ops``): each choice, every cell where it left the rule's and by how much, the
  share of samples set aside, the other processes' load, and whether it came from the cache,
  a fresh calibration (with its time) or is provisional, or that calibration is off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from . import build, timing
from .timing import cpu_identity

logger = logging.getLogger("symphony.ops")

ENV, SETTINGS = "SYMPHONY_QLINEAR_CALIBRATION", ("auto", "force", "off")
MODES, KINDS = (-1, -2), (0, 1)         # float-accurate, int8 activations; u4, i8 (csrc/quant.h)
KIND_NAMES = {0: "u4", 1: "i8"}
DENSE_PATHS = (3, 13)           # the dense GEMMs, float32 and bfloat16: more rows amortize their dequantization
# (first row of the bucket, rows timed for it, calls a sample)
BUCKETS = ((1, 1, 4), (2, 2, 4), (4, 8, 2), (16, 24, 1), (32, 48, 1), (64, 96, 1), (128, 128, 1), (256, 512, 1))
TAIL = (128, 512)                       # rows timed for the open-ended range (`_choose`)
SHAPE = (1536, 576)                     # [N, K] of the weights timed
COPIES = 8                              # of it, called in turn: 3.5-7 MiB, beyond a core's L2
MIN_CLEAN = 5                           # samples kept per path and bucket
MAX_ROUNDS = 40                         # rounds per bucket at most
CLEAN = 0.1                             # share of a sample the other threads may wait for a core
PRUNE, MARGIN, WIN = 2.0, 0.02, 0.75
PROXY_MARGIN = 0.15                     # where the rows were timed at one thread instead
QUIET_CORES = 0.3                       # other processes' load (cores) below which the box is quiet
BUDGET_S, WALL_S = 5.0, 15.0            # CPU seconds of the calling thread; wall seconds
VERSION = 5


@dataclasses.dataclass
class Calibration:
    """qlinear's automatic choices: ``choices[(mode, kind)]`` one path per bucket (``rows``: the
    buckets' first rows), ``rules`` the same for the rule of resolve_path; ``times[(kind, rows
    timed, path)]`` the seconds a call measured (`low`: the lower quartile, samples that waited
    for a core set aside); ``source`` "calibrated", "cache", "off" or "failed" (the last two: the rule, no
    choices); ``complete`` whether every bucket was measured, ``load`` the other processes' CPU
    use meanwhile (cores; None where unknown), ``kept`` the share of samples kept, ``quiet``
    whether the box was quiet (`QUIET_CORES`). Not complete, not quiet, or rows timed at one thread
    for a team (``one_thread``) but not ``retried``: ``provisional``."""

    rows: tuple[int, ...]
    choices: dict[tuple[int, int], list[int]]
    times: dict[tuple[int, int, int], float]
    source: str
    complete: bool = True
    quiet: bool = True
    seconds: float = 0.0
    cache: Optional[Path] = None
    rules: dict[tuple[int, int], list[int]] = dataclasses.field(default_factory=dict)
    load: Optional[float] = None
    kept: float = 1.0
    one_thread: tuple[int, ...] = ()
    unmeasured: tuple[str, ...] = ()
    retried: bool = False                        # timed at one thread again after a cache that was

    @property
    def provisional(self) -> bool:
        return not (self.complete and self.quiet) or (bool(self.one_thread) and not self.retried)

    def describe(self) -> str:
        """The choices as one line: ``-1 u4: 1 12, 2-3 12, 4-15 11, ...; ...``, then each cell
        that left the rule's choice and by how much, and how the timings were taken."""
        if not self.choices:
            why = f"{ENV}=off" if self.source == "off" else "it failed"
            return f"qlinear calibration off ({why}): the built-in rule of csrc/cpu/qlinear.cpp"
        spans = [f"{a}-{b - 1}" if b - 1 > a else f"{a}" for a, b in zip(self.rows, self.rows[1:])]
        spans.append(f"{self.rows[-1]}+")
        cells = "; ".join(f"{mode} {KIND_NAMES[kind]}: " + ", ".join(
            f"{s} {p}" for s, p in zip(spans, self.choices[(mode, kind)]))
            for mode in MODES for kind in KINDS)
        how = f"calibrated in {self.seconds:.2f} s" if self.source == "calibrated" else f"from the cache {self.cache}"
        how += f", other processes' load {'unknown' if self.load is None else f'{self.load:.1f} cores'}, " \
               f"{self.kept:.0%} of samples kept"
        if self.one_thread:
            how += f", rows {', '.join(map(str, self.one_thread))} timed at one thread (the cores were taken)"
        if not self.complete:
            how += f", budget spent: buckets not measured ({', '.join(self.unmeasured)}) keep the rule's choice"
        if self.provisional:
            how += ", provisional (measured again once the box is quiet)"
        return f"qlinear paths by rows ({how}): {cells}; {self.why()}"

    def why(self) -> str:
        """Each cell whose choice is not the rule's: ``-1 u4 from 4 rows: 11 for 3, -40%``."""
        moved = []
        for (mode, kind), paths in self.choices.items():
            for b, p in enumerate(paths):
                r = self.rules.get((mode, kind), paths)[b]
                if p == r:
                    continue
                m = BUCKETS[b][1] if b < len(BUCKETS) else None
                tp, tr = self.times.get((kind, m, p)), self.times.get((kind, m, r))
                by = f", {tp / tr - 1:+.0%}" if tp and tr else ""
                moved.append(f"{mode} {KIND_NAMES[kind]} from {self.rows[b]} rows: {p} for {r}{by}")
        return ("left the rule: " + "; ".join(moved)) if moved else "the rule's choice in every cell"


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def setting() -> str:
    """``$SYMPHONY_QLINEAR_CALIBRATION``: auto (also when unset), force or off; else ValueError."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in SETTINGS:
        raise ValueError(f"{ENV} must be one of {', '.join(SETTINGS)}, got {value!r}")
    return value


def ensure_for(device: torch.device, quantized: bool) -> Optional[Calibration]:
    """`ensure` for quantized weights on the CPU (which take qlinear's automatic choices); else None."""
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
                calib, proxied = read_cache(path, key) if mode == "auto" else None, False
                if calib is not None and calib.provisional and _is_quiet(timing.box_load()):
                    logger.info("qlinear calibration cache %s is provisional and the box is quiet now: "
                                "calibrating again", path)
                    calib, proxied = None, bool(calib.one_thread)
                if calib is None:               # a team timed at one thread twice running: kept
                    calib = measure()
                    calib.retried = proxied and bool(calib.one_thread)
            except RuntimeError as e:
                logger.warning("qlinear calibration failed (%s): the built-in rule decides", e)
                calib = Calibration((), {}, {}, "failed")
            if calib.source == "calibrated":
                calib.cache = write_cache(path, key, calib)
            install(calib)
        logger.info("%s", calib.describe())
        _installed.clear()
        _installed[(mode, threads)] = calib
        return calib


def measure(budget_s: float = BUDGET_S, wall_s: float = WALL_S) -> Calibration:
    """Time the paths (module docstring) and pick per mode, kind and bucket; the ops' table must
    hold no choices meanwhile (`clear`), as the rule fills unmeasured cells."""
    t0, c0, load0 = time.perf_counter(), time.thread_time(), timing.cpu_ticks()
    allowed = {mode: auto_paths(mode) for mode in MODES}
    candidates = sorted(set().union(*allowed.values()))        # (pruned as the buckets go)
    gen = torch.Generator().manual_seed(0)
    samples: dict[tuple[int, int, int], list[float]] = {}     # (kind, rows, path) -> kept seconds
    complete, n_all, n_kept, threads = True, 0, 0, torch.get_num_threads()
    proxied: set = set()                                      # rows timed at one thread instead
    unmeasured: list[str] = []
    for kind in KINDS:
        ws = [_weight(kind, gen) for _ in range(COPIES)]
        alive = list(candidates)
        for b, (_, m, calls) in enumerate(BUCKETS):
            x = torch.randn(m, SHAPE[1], generator=gen)       # [M, K]
            bucket: dict = {}
            # each mode's paths in rounds of their own: a float kernel is timed beside the others
            # the float choice weighs it against, not after an int8 kernel that left other data
            # in the caches (which moved the 1-row choice between two kernels within 10 %)
            for i, mode in enumerate(MODES):
                left = (len(BUCKETS) * (len(KINDS) - kind) - b) * len(MODES) - i   # groups to go: each its share
                rules = {_rule(mode, m, kind)}                # always timed: the baseline
                fns = {p: qlinear_cycling(x, ws, kind, p) for p in allowed[mode]   # (a path the mode before
                       if p in rules or (p in alive and p not in bucket)}             # timed is not timed again)
                for fn in [f for f in fns.values() for _ in range(COPIES)]:
                    fn()                                      # a whole cycle first (docstring)
                got, total = {}, 0
                if not proxied:                               # (once the cores were taken: one thread; half
                    parts = 2 * left if threads > 1 else left     # the share is kept for that, with a team)
                    got, total = _time_bucket(fns, calls, rules, _share(c0 + budget_s, t0 + wall_s, parts))
                    if not _measured(got, rules) and threads > 1 and _kept(got) * 4 >= total * 3:
                        # few samples set aside: the share ran out (slow paths, many rows), not the
                        # cores: the team goes on in the half kept for one thread
                        more_got, more = _time_bucket(fns, calls, rules, _share(c0 + budget_s, t0 + wall_s, left))
                        got = {p: got.get(p, []) + more_got.get(p, []) for p in {*got, *more_got}}
                        total += more
                if not _measured(got, rules) and threads > 1:  # the cores are taken: the same on one
                    with timing.torch_threads(1):
                        got, more = _time_bucket(fns, calls, rules, _share(c0 + budget_s, t0 + wall_s, left))
                    total += more
                    proxied.add(m if _measured(got, rules) else None)
                n_all, n_kept = n_all + total, n_kept + _kept(got)
                for p, s in got.items():
                    bucket.setdefault(p, []).extend(s)
                if not _measured(got, rules):
                    complete = False
                    unmeasured.append(f"{KIND_NAMES[kind]} at {m} rows ({'int8' if mode == -2 else 'float'})")
            got = bucket
            samples.update({(kind, m, p): s for p, s in got.items()})
            fast = {p: min(s) for p, s in got.items() if s}  # (a path dropped after a round has one)
            best = {mode: min([fast[q] for q in allowed[mode] if q in fast], default=0.0) for mode in MODES}
            alive = [p for p in alive if p in DENSE_PATHS or p not in fast or any(    # vs its modes' fastest
                     fast[p] <= PRUNE * best[mode] for mode in MODES if p in allowed[mode])]
    choices = {(mode, kind): [_choose(mode, kind, m, allowed[mode], samples,
                                      PROXY_MARGIN if m in proxied else MARGIN) for _, m, _ in BUCKETS]
               for mode in MODES for kind in KINDS}
    rules = {(mode, kind): [_rule(mode, m, kind) for _, m, _ in BUCKETS] for mode in MODES for kind in KINDS}
    times = {c: low(s) for c, s in samples.items() if s}
    load = timing.others_load(load0, timing.cpu_ticks())
    return Calibration(tuple(b[0] for b in BUCKETS), choices, times, "calibrated", complete,
                       _is_quiet(load), time.perf_counter() - t0, rules=rules, load=load,
                       kept=n_kept / max(1, n_all), one_thread=tuple(sorted(proxied - {None})),
                       unmeasured=tuple(unmeasured))


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
            "plan": {"shape": list(SHAPE), "copies": COPIES, "scales": "float16", "buckets": [list(b) for b in BUCKETS],
                     "min_clean": MIN_CLEAN, "max_rounds": MAX_ROUNDS, "clean": CLEAN,
                     "prune": PRUNE, "margin": MARGIN, "win": WIN}}


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
        rules = {(mode, kind): [int(p) for p in data["rules"][str(mode)][str(kind)]]
                 for mode in MODES for kind in KINDS} if "rules" in data else {}
        if any(len(c) != len(rows) for c in rules.values()):
            raise ValueError("a rule per bucket expected")
        load = data.get("load_cores")
        how = dict(complete=bool(data.get("complete", True)), quiet=bool(data.get("quiet", True)),
                   load=None if load is None else float(load), kept=float(data.get("kept", 1.0)),
                   one_thread=tuple(int(m) for m in data.get("one_thread", ())), retried=data.get("retried") is True)
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
    return Calibration(rows, choices, times, "cache", cache=path, rules=rules, **how)


def write_cache(path: Path, key: dict, calib: Calibration) -> Optional[Path]:
    """Write ``calib`` to ``path`` atomically; the path, or None (logged) if it cannot be."""
    times: dict = {}
    for (kind, m, p), t in sorted(calib.times.items()):
        times.setdefault(str(kind), {}).setdefault(str(m), {})[str(p)] = t
    data = {"key": key, "rows": list(calib.rows),
            "choices": {str(mode): {str(kind): calib.choices[(mode, kind)] for kind in KINDS} for mode in MODES},
            "times_s": times, "complete": calib.complete, "quiet": calib.quiet, "load_cores": calib.load,
            "kept": calib.kept, "one_thread": list(calib.one_thread), "retried": calib.retried}
    if calib.rules:
        data["rules"] = {str(mode): {str(kind): calib.rules[(mode, kind)] for kind in KINDS} for mode in MODES}
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


def qlinear_cycling(x: torch.Tensor, ws: list, kind: int, path: int):
    """A callable: ``x`` times the next of the weights ``ws`` (`_weight`'s) on ``path``, so that
    a call reads its weight from beyond the core's own caches, as a decode step does."""
    turn = itertools.cycle(ws)
    op = torch.ops.symphony.qlinear

    def call():
        qs, scales, mins, group = next(turn)
        return op(x, qs, scales, mins, kind, group, path)
    return call


def _weight(kind: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A random quantized ``SHAPE`` weight of ``kind``, groups of 32: (qs, scales, mins, group),
    float16 scales (and mins for u4) as GGUF's Q4_1 and Q8_0 keep them (widening costs here too)."""
    n, k = SHAPE
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).half()     # [N, K/32]
    if kind == 0:
        qs = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        mins = -8 * scales
    else:
        qs = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        mins = torch.empty(0, dtype=torch.float16)
    return qs, scales, mins, 32


def _choose(mode: int, kind: int, m: int, allowed: list[int],
            samples: dict[tuple[int, int, int], list[float]], margin: float = MARGIN) -> int:
    """The path ``mode`` takes at ``m`` rows: among the measured paths (`MIN_CLEAN` samples)
    that beat the rule's choice clearly (lower quartile, `low`, more than ``margin`` lower,
    faster in `WIN` of the pairs), the one with the lowest; the rule's if none does or it was not
    measured.
    In the `TAIL` a dense rule choice yields only to a GEMM or a path winning at every TAIL row."""
    def better(m: int) -> dict:
        rule = _rule(mode, m, kind)
        timed = {p: samples[(kind, m, p)] for p in allowed if len(samples.get((kind, m, p), ())) >= MIN_CLEAN}
        if rule not in timed:
            return {}
        med = {p: low(s) for p, s in timed.items()}
        return {p: med[p] for p in timed if p != rule and med[p] * (1 + margin) < med[rule]
                and timing.wins(timed[p], timed[rule]) >= WIN}
    rule, got = _rule(mode, m, kind), better(m)
    if m in TAIL and rule in DENSE_PATHS:                 # the open-ended range (module docstring)
        everywhere = set.intersection(*(set(better(t)) for t in TAIL))
        got = {p: t for p, t in got.items() if p in DENSE_PATHS or p in everywhere}
    return min(got, key=lambda p: (got[p], p)) if got else rule


def low(samples: list[float]) -> float:
    """A path's time from its kept samples: their lower quartile (the module's docstring)."""
    return sorted(samples)[len(samples) // 4]


def _time_bucket(fns, calls: int, rules: set, limits) -> tuple[dict, int]:
    """(Small calls are noisier, and cheap: `MIN_CLEAN` samples a call of a sample.)"""
    return timing.interleaved(fns, calls=calls, min_kept=MIN_CLEAN * calls, max_rounds=MAX_ROUNDS * calls,
                              clean=CLEAN, keep=frozenset(rules), prune=PRUNE, limits=limits)


def _share(cpu_end: float, wall_end: float, parts: int) -> tuple[float, float]:
    """Limits (thread CPU, wall) of one of ``parts`` equal shares of what is left until the ends."""
    c, t = time.thread_time(), time.perf_counter()
    return c + (cpu_end - c) / max(1, parts), t + (wall_end - t) / max(1, parts)


def _kept(got: dict) -> int:
    return sum(len(s) for s in got.values())


def _measured(got: dict, rules: set) -> bool:
    return all(len(got.get(p, ())) >= MIN_CLEAN for p in rules)


def _is_quiet(load: Optional[float]) -> bool:
    return load is None or load < QUIET_CORES


def _rule(mode: int, m: int, kind: int) -> int:
    """The rule's choice (resolve_path with no table) for ``m`` rows of the timed shape."""
    from . import qlinear_path_for
    return qlinear_path_for(mode, m, SHAPE[0], SHAPE[1], kind)
