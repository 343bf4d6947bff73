"""The CPU: LIP workers never take it from the forward pass.

Every LIP worker runs in the kernel's session (no scheduling group of its own:
under sched_autogroup, a LIP in a session of its own got as much CPU as the
whole kernel), at the nice value it was started with (`--lip-nice`, default
0), so a LIP that mostly waits for its calls is woken as promptly as the
kernel's own threads.  A LIP that computes instead is *demoted*: every
`CHECK_EVERY_S` the event loop reads each running LIP's CPU time
(/proc/PID/stat) and its system calls (the serving snapshot), and one that
used more than ``busy`` of a core since the last look, more than `PER_CALL_S`
of it per call, is *demoted*, all its threads: nice 19 and the SCHED_IDLE
policy, so it runs only on CPU time no other thread wants, and any other
thread's wake-up (the kernel's, a waiting LIP's) preempts it at once.  (At
nice 19 alone a thread keeps its slice once running: 12 such threads on 2
cores slow a decoding neighbour 3.5-4.5x, under SCHED_IDLE 1.2-1.7x.)  (A LIP
decoding as fast as the model answers uses a fraction of a millisecond a call;
one spread over many processes still shows its CPU per call.)  A root kernel
gives a demoted LIP its policy and nice back once it has been quiet (under a
tenth of ``busy``) for `QUIET_S`; a kernel that is not root cannot (raising a
priority needs the privilege), so its LIPs stay demoted once busy.  What no
policy does: share the CPU between users (cgroup v2 ``cpu.weight`` per user
would, under a root kernel; not done), or
keep the users' own processes, outside the kernel, from competing with it.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Iterable, Optional

log = logging.getLogger("symphony.kernel")

CHECK_EVERY_S = 0.5
PER_CALL_S = 0.002          # CPU per system call above which a LIP computes rather than waits
QUIET_S = 5.0
DEMOTED_NICE = 19
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class _Seen:
    pid: int
    cpu_s: float
    calls: int
    at: float
    demoted: bool = False
    quiet_since: Optional[float] = None


class CpuGovernor:
    """Demotes busy LIP workers (the event loop's; nothing here blocks long)."""

    def __init__(self, busy: float, nice: int, can_restore: bool):
        self.busy, self.nice, self.can_restore = busy, nice, can_restore
        self._seen: dict[int, _Seen] = {}          # lip -> what was seen of its worker
        self.demotions = 0

    def check(self, running: Iterable[tuple[int, int, int, int]], now: Optional[float] = None) -> None:
        """One look at the running LIPs, each (lip, pid, uid, system calls so far):
        demote the busy, restore the quiet (root only); forget the gone."""
        now = time.monotonic() if now is None else now
        live = set()
        for lip, pid, uid, calls in running:
            live.add(lip)
            cpu = _cpu_s(pid, uid)
            if cpu is None:
                continue
            s = self._seen.get(lip)
            if s is None or s.pid != pid:
                self._seen[lip] = _Seen(pid, cpu, calls, now)
                continue
            used = cpu - s.cpu_s
            rate, per_call = used / max(now - s.at, 1e-3), used / max(1, calls - s.calls)
            s.cpu_s, s.calls, s.at = cpu, calls, now
            if not s.demoted and rate > self.busy and per_call > PER_CALL_S:
                if _renice(pid, DEMOTED_NICE, idle=True):
                    s.demoted, s.quiet_since = True, None
                    self.demotions += 1
                    log.info("LIP %d demoted to SCHED_IDLE: it used %.0f%% of a core", lip, 100 * rate)
            elif s.demoted and self.can_restore:
                if rate > self.busy / 10:
                    s.quiet_since = None
                elif s.quiet_since is None:
                    s.quiet_since = now
                elif now - s.quiet_since >= QUIET_S and _renice(pid, self.nice):
                    s.demoted = False
                    log.info("LIP %d back to nice %d after %.0f s quiet", lip, self.nice, QUIET_S)
        for lip in [l for l in self._seen if l not in live]:
            del self._seen[lip]


def _cpu_s(pid: int, uid: int) -> Optional[float]:
    """The CPU time (user + system, all threads) of process ``pid`` if it still
    runs as ``uid`` (a pid reused by another process is left alone)."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != uid:
            return None
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, ValueError, IndexError):
        return None


def _renice(pid: int, nice: int, idle: bool = False) -> bool:
    """Set the nice value of every thread of ``pid`` (Linux nice values are per
    thread) and its policy: SCHED_IDLE when ``idle`` (a demotion), else
    SCHED_OTHER (leaving SCHED_IDLE needs a root kernel)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return False
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    done = False
    for tid in tids:
        try:
            if policy == os.SCHED_OTHER:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            if policy == os.SCHED_IDLE:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            done = True
        except OSError:                         # the thread ended, or lowering needs root
            pass
    return done
