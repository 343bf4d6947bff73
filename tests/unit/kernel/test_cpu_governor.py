"""The CPU governor (kernel/loop/cpu.py) on real processes: a child that spins
is demoted (every thread: nice 19, SCHED_IDLE), one that waits is not, and a
process gone or of another uid is left alone."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from symphony.kernel.loop import cpu

SPIN = ("import threading\n"
        "def spin():\n    x = 0\n    while True:\n        x = (x * 31 + 7) % 1000003\n"
        "threading.Thread(target=spin, daemon=True).start()\nspin()\n")


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def _look(gov: cpu.CpuGovernor, procs: dict[int, subprocess.Popen], now: float) -> None:
    gov.check([(lip, p.pid, os.getuid(), 0) for lip, p in procs.items()], now=now)


def test_a_spinning_process_is_demoted_and_a_waiting_one_is_not():
    busy = subprocess.Popen([sys.executable, "-c", SPIN])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    procs = {1: busy, 2: idle}
    try:
        time.sleep(0.3)                                 # both threads of the spinner started
        gov = cpu.CpuGovernor(busy=0.1, nice=0, can_restore=False)
        t0 = time.monotonic()
        _look(gov, procs, t0)
        time.sleep(0.6)
        _look(gov, procs, time.monotonic())
        assert gov.demotions == 1
        tids = _threads(busy.pid)
        assert len(tids) >= 2
        for tid in tids:
            assert os.sched_getscheduler(tid) == os.SCHED_IDLE
            assert os.getpriority(os.PRIO_PROCESS, tid) == cpu.DEMOTED_NICE
        for tid in _threads(idle.pid):
            assert os.sched_getscheduler(tid) == os.SCHED_OTHER
            assert os.getpriority(os.PRIO_PROCESS, tid) == 0
        # a LIP gone from the running set is forgotten
        _look(gov, {2: idle}, time.monotonic())
        assert set(gov._seen) == {2}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a priority back needs root")
def test_a_root_kernel_gives_a_quiet_lip_its_policy_back():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        assert cpu._renice(p.pid, cpu.DEMOTED_NICE, idle=True)
        assert os.sched_getscheduler(p.pid) == os.SCHED_IDLE
        gov = cpu.CpuGovernor(busy=0.1, nice=0, can_restore=True)
        t0 = time.monotonic()
        _look(gov, {1: p}, t0)
        gov._seen[1].demoted = True
        _look(gov, {1: p}, t0 + 1)                      # quiet from here
        _look(gov, {1: p}, t0 + 1 + cpu.QUIET_S)
        assert not gov._seen[1].demoted
        assert os.sched_getscheduler(p.pid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, p.pid) == 0
    finally:
        p.kill()
        p.wait()


def test_a_pid_of_another_uid_or_gone_is_left_alone():
    assert cpu._cpu_s(os.getpid(), os.getuid() + 1) is None
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert cpu._cpu_s(p.pid, os.getuid()) is None
    assert not cpu._renice(p.pid, cpu.DEMOTED_NICE, idle=True)
