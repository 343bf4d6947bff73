"""Timing kernels on a busy CPU: interleaved rounds, samples that waited for a core set aside.

On a shared machine another process may hold a core for milliseconds in the middle of a call
that takes microseconds; a median of wall times then measures the scheduler, not the kernel.
`interleaved` takes samples of several callables in rounds (one sample of each a round, so that
drift hits every one alike; in a new order each round, so that none always follows the same
one, whose traces in the caches it would always meet). A sample's cost is the CPU time of the
calling thread (which a process holding the core meanwhile does not add to, while what it
costs the kernel, such as caches the other process cooled, stays in); with a thread team, the
calling thread also waits at its barriers for the others, so a sample in which the other
threads of this process waited, runnable, for a core (Linux's per-thread run-queue wait,
/proc/self/task/*/schedstat) for more than ``clean`` of its cost (plus 5 us) is set aside
(`kept`), as are outliers among the rest. `box_load` says how busy the other processes keep
the machine (/proc/stat less this process); `cpu_identity` names the CPU the timings hold for
(what a cached calibration is keyed by).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import random
import statistics
import threading
import time
from typing import Callable, Hashable, Optional


def interleaved(fns: dict[Hashable, Callable[[], object]], *, calls: int = 1, min_kept: int = 7,
                max_rounds: int = 60, clean: float = 0.1, keep: frozenset = frozenset(),
                prune: float = float("inf"), limits: tuple[float, float] = (float("inf"), float("inf")),
                ) -> tuple[dict[Hashable, list[float]], int]:
    """Rounds of samples of each of ``fns`` (a sample: ``calls`` calls, CPU seconds of the
    calling thread a call): the kept seconds per key (`kept`) and how many samples were taken in all. Keys not in ``keep``
    whose fastest sample took more than ``prune`` times the fastest key's time (its kept
    median, or its fastest sample) are dropped after a round (each key is called once before
    the first round, untimed: a first call's first touches are no sample);
    rounds stop once every key left has ``min_kept`` kept samples, after ``max_rounds``, or past
    ``limits`` (CPU seconds of the calling thread by `time.thread_time`, `time.perf_counter`
    seconds)."""
    raw: dict[Hashable, list[tuple[float, float]]] = {k: [] for k in fns}
    live, total, rng = list(fns), 0, random.Random(0)
    for fn in fns.values():                  # first touches (buffers, pages) out of the samples
        fn()
    with _RunQueueWait() as waited:
        for r in range(max_rounds):
            if time.thread_time() > limits[0] or time.perf_counter() > limits[1]:
                break
            for k in rng.sample(live, len(live)):   # no path always after the same one
                fn, w0, c = fns[k], waited(), time.thread_time()
                for _ in range(calls):
                    fn()
                cost = time.thread_time() - c
                raw[k].append((cost / calls, (waited() - w0) / calls))
                total += 1
            got = {k: kept(raw[k], clean) for k in live}
            fast = {k: min(t for t, _ in raw[k]) for k in live}     # a bound no wait can lower
            best = min([statistics.median(s) for s in got.values() if s] + list(fast.values()))
            live = [k for k in live if k in keep or fast[k] <= prune * best]
            if all(len(got[k]) >= min_kept for k in live):
                break
    return {k: kept(raw[k], clean) for k in fns}, total


def kept(samples: list[tuple[float, float]], clean: float = 0.1) -> list[float]:
    """The costs of the samples (cost, seconds the other threads waited for a core) whose other
    threads waited at most ``clean`` of the cost plus 5 us, less outliers: beyond 3 median
    absolute deviations of their median (at least 2 % of it)."""
    ok = [t for t, w in samples if w <= clean * t + 5e-6]
    if len(ok) < 3:
        return ok
    med = statistics.median(ok)
    mad = max(statistics.median(abs(t - med) for t in ok), 0.02 * med)
    return [t for t in ok if abs(t - med) <= 3 * mad]


def wins(a: list[float], b: list[float]) -> float:
    """The share of pairs (one sample of each) in which ``a``'s is the faster."""
    return sum(x < y for x in a for y in b) / (len(a) * len(b))


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's thread count ``n`` inside, the caller's again after."""
    import torch
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def box_load(window_s: float = 0.2) -> Optional[float]:
    """The CPU other processes use now, in cores (averaged over ``window_s``; this process left
    out), or None where /proc does not say."""
    a = cpu_ticks()
    time.sleep(window_s)
    return others_load(a, cpu_ticks())


class _RunQueueWait:
    """Context manager giving a function that returns the seconds the other threads of this
    process (as of entry: torch's thread team once it has run) have waited, runnable, for a
    core (schedstat's second field, summed); 0 where /proc does not say."""

    def __enter__(self):
        self.fds = []
        me = str(threading.get_native_id())
        try:
            for t in os.listdir("/proc/self/task"):
                if t != me:
                    with contextlib.suppress(OSError):
                        self.fds.append(os.open(f"/proc/self/task/{t}/schedstat", os.O_RDONLY))
        except OSError:
            pass
        return self.read

    def read(self) -> float:
        total = 0
        for fd in self.fds:
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int(os.pread(fd, 128, 0).split()[1])
        return total / 1e9

    def __exit__(self, *exc):
        for fd in self.fds:
            os.close(fd)


def cpu_ticks() -> Optional[tuple[float, float, float]]:
    """(monotonic seconds, CPU seconds every process has used, CPU seconds this process has
    used), or None where /proc does not say."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        busy = sum(int(v) for i, v in enumerate(fields[1:9]) if i not in (3, 4))  # less idle, iowait
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        mine = int(own[11]) + int(own[12])                                       # utime + stime
    except (OSError, ValueError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return time.monotonic(), busy / hz, mine / hz


def others_load(a, b) -> Optional[float]:
    """Other processes' CPU use between two `cpu_ticks` readings, in cores."""
    if a is None or b is None or b[0] <= a[0]:
        return None
    return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / (b[0] - a[0]))


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
