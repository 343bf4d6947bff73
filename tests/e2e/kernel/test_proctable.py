"""The process table (kernel/loop/proctable.py) and the snapshots the kernel's two
threads publish for each other (kernel/snapshot.py).

  * unit: every transition of the lifecycle state machine, the first kill
    reason winning, exit reasons, the finished list's bound, the per-user
    count, and snapshots that are replaced, never changed;
  * threads: one owner thread drives random lifecycles while readers in
    other threads take snapshots: no torn state, ever;
  * ServedLips.swap_out_first: blocked LIPs only, in swap-out order;
  * a real kernel on the tiny model: ps/stats hammered by clients while LIPs
    start, exit and are killed never fail and never show a torn table; stats
    are exact once the kernel is idle; finished LIPs keep their counters.
"""
import random
import signal
import threading
import time

import pytest

from symphony.kernel.syscall.proc import LipProc, ServedLips
from symphony.kernel.loop.proctable import FINISHED_KEPT, LIVE, ProcessTable, TransitionError, exit_reason
from symphony.kernel.snapshot import LipCounters, ProcRow, ServingSnapshot
from symphony.kernel.states import LipState

from .test_faults import WORKER, fk, tiny_gguf  # noqa: F401  (fixtures)


def row(lip, user="alice", **kw):
    d = dict(lip=lip, user=user, file="p.py", state="starting", priority=0, pid=0, started=0.0,
             args=("a",), limits={"timeout": 5})
    d.update(kw)
    return ProcRow(**d)


# ---------------------------------------------------------------- the state machine
def test_a_lip_goes_starting_running_killing_exiting_exited():
    t = ProcessTable()
    e = t.add(row(1), ring=None)
    assert e.state == "starting" and e.pid == 0 and len(t) == 1 and t.count_for("alice") == 1
    assert t.started(1, 4242) is None
    assert (t.get(1).state, t.get(1).pid) == ("running", 4242)
    assert t.kill(1, "killed by alice") is e and e.state == "killing"
    assert t.kill(1, "second reason") is e and e.reason == "killed by alice"   # the first reason wins
    assert t.exit_reported(1) is e and e.state == "exiting"
    assert t.exit_reported(1) is None                                          # reclaim already under way
    got = t.reclaimed(1, -9, signal.SIGKILL, LipCounters(7, 3, 12, 0))
    assert got is not None
    assert got[1] == {"event": "exit", "lip": 1, "status": 128 + 9, "reason": "killed by alice"}
    assert len(t) == 0 and t.get(1) is None and t.count_for("alice") == 0
    (fin, ev), = t.snapshot.finished
    assert (fin.state, fin.pid, fin.final) == ("exited", 4242, LipCounters(7, 3, 12, 0)) and ev is got[1]
    assert t.reclaimed(1, 0, 0, LipCounters()) is None                         # only once


def test_killed_while_starting_is_signalled_once_its_pid_is_known():
    t = ProcessTable()
    t.add(row(1), ring=None)
    e = t.kill(1, "killed: the client that ran it disconnected")
    assert (e.state, e.pid) == ("killing", 0)                                  # no pid to signal yet
    assert t.started(1, 99) == "killed: the client that ran it disconnected"  # the caller signals now
    assert (t.get(1).state, t.get(1).pid) == ("killing", 99)
    assert t.started(1, 100) is None and t.get(1).pid == 99                    # one pid, once


def test_an_exiting_lip_is_not_killed_again_and_keeps_its_own_reason():
    t = ProcessTable()
    t.add(row(1), ring=None)
    t.started(1, 5)
    t.exit_reported(1)
    e = t.kill(1, "killed by bob")
    assert e.state == "exiting" and e.reason is None                         # dead already: its pid may be reused
    assert t.reclaimed(1, 0, 0, LipCounters())[1]["reason"] == "finished"
    assert t.kill(1, "late") is None and t.started(1, 6) is None and t.exit_reported(1) is None


@pytest.mark.parametrize("status, sig, reason", [
    (0, 0, "finished"), (1, 0, "error"), (3, 0, "exit status 3"),
    (-1, signal.SIGXCPU, "killed: CPU time limit exceeded"), (-1, signal.SIGSYS,
                                                              "killed by the sandbox (forbidden system call)"),
    (-1, signal.SIGSEGV, "crashed (segmentation fault)"), (-1, signal.SIGKILL, "killed"),
    (-1, signal.SIGTERM, f"killed by signal {int(signal.SIGTERM)}")])
def test_exit_reasons(status, sig, reason):
    assert exit_reason(status, sig) == reason
    t = ProcessTable()
    t.add(row(1), ring=None)
    t.exit_reported(1)
    ev = t.reclaimed(1, status, sig, LipCounters())[1]
    assert ev["reason"] == reason and ev["status"] == (status if sig == 0 else 128 + sig)


def test_abandon_ends_an_exiting_lip_whose_reclaim_never_came():
    t = ProcessTable()
    t.add(row(1), ring=None)
    t.kill(1, "kernel shutting down")
    assert t.abandon(1, " (not reclaimed)") is None                           # only an exiting LIP
    t.exit_reported(1)
    ev = t.abandon(1, " (not reclaimed)")[1]
    assert ev["reason"] == "kernel shutting down (not reclaimed)" and ev["status"] == 137
    assert len(t) == 0 and t.reclaimed(1, 0, 0, LipCounters()) is None       # a late reclaim tells nobody


def test_rules_a_kernel_bug_would_break():
    t = ProcessTable()
    t.add(row(1), ring=None)
    with pytest.raises(TransitionError):
        t.add(row(1), ring=None)
    assert t.get("1") is None and t.get([1]) is None and "x" not in t


def test_every_move_the_table_makes_is_in_its_transitions_and_no_other_is_allowed():
    """Drive each path of the state machine and record every (old, new) state
    the rows go through: each one is in `TRANSITIONS`, and each entry of the
    table is taken by some path (no dead rules)."""
    from symphony.kernel.loop.proctable import TRANSITIONS, _check
    seen = set()
    t = ProcessTable()

    def track(lip, step):
        old = t.get(lip).state if t.get(lip) else None
        step()
        e = t.get(lip)
        new = e.state if e else next(r.state for r, _ in reversed(t.snapshot.finished) if r.lip == lip)
        seen.add((old, new))

    track(1, lambda: t.queue(row(1)))
    track(1, lambda: t.drop(1, "killed"))                         # queued -> exited
    track(2, lambda: t.queue(row(2)))
    track(2, lambda: t.admit(2, ring=None))                       # queued -> starting
    track(2, lambda: t.started(2, 20))                            # starting -> running
    track(2, lambda: t.kill(2, "killed"))                         # running -> killing
    track(2, lambda: t.exit_reported(2))                          # killing -> exiting
    track(2, lambda: t.reclaimed(2, 0, 9, LipCounters()))         # exiting -> exited
    track(3, lambda: t.add(row(3), ring=None))                    # (none) -> starting
    track(3, lambda: t.kill(3, "killed"))                         # starting -> killing
    track(3, lambda: t.started(3, 30))                            # killing stays killing, pid known
    track(4, lambda: t.add(row(4), ring=None))
    track(4, lambda: t.exit_reported(4))                          # starting -> exiting
    track(5, lambda: t.add(row(5), ring=None))
    track(5, lambda: t.started(5, 50))
    track(5, lambda: t.exit_reported(5))                          # running -> exiting
    track(5, lambda: t.abandon(5, " (not reclaimed)"))            # exiting -> exited
    table = {(old, new) for old, news in TRANSITIONS.items() for new in news}
    assert seen == table, (seen ^ table)
    assert all(isinstance(new, LipState) for _, new in seen)
    for old in TRANSITIONS:
        for new in set(LipState) - TRANSITIONS[old]:
            with pytest.raises(TransitionError):
                _check(0, old, new)


def test_lip_states_are_the_words_ps_and_the_wire_show():
    import json

    import orjson
    assert [s.value for s in LipState] == ["queued", "starting", "running", "suspended", "killing", "exiting",
                                           "exited"]
    r = row(3, state=LipState.RUNNING)
    assert orjson.loads(orjson.dumps(r.ps(LipCounters(), True)))["state"] == "running"
    assert json.dumps(LipState.KILLING) == '"killing"' and f"{LipState.QUEUED}" == str(LipState.QUEUED) == "queued"
    assert LipState.EXITED == "exited" and "exited" in {LipState.EXITED} and LipState("running") is LipState.RUNNING


def test_snapshots_are_replaced_never_changed():
    t = ProcessTable()
    s0 = t.snapshot
    t.add(row(1), ring=None)
    s1 = t.snapshot
    t.started(1, 10)
    s2 = t.snapshot
    assert s0.rows == () and s1.rows[0].state == "starting" and s2.rows[0].state == "running"
    assert s0.version < s1.version < s2.version
    with pytest.raises(AttributeError):
        s2.rows[0].state = "exited"                                            # frozen rows


def test_finished_is_bounded_and_users_are_counted():
    t = ProcessTable()
    n = FINISHED_KEPT + 30
    for i in range(1, n + 1):
        t.add(row(i, user="bob" if i % 2 else "carol"), ring=None)
    assert (t.count_for("bob"), t.count_for("carol"), t.count_for("dave")) == (n // 2, n // 2, 0)
    for i in range(1, n + 1):
        t.exit_reported(i)
        t.reclaimed(i, 0, 0, LipCounters())
    fin = t.snapshot.finished
    assert len(fin) == FINISHED_KEPT and [r.lip for r, _ in fin] == list(range(31, n + 1))
    assert t.count_for("bob") == 0 and len(t) == 0


def test_ps_row_hides_another_users_arguments():
    r = row(3, args=("secret prompt",), pid=7, state="running")
    c = LipCounters(5, 2, 40, 0)
    full, other = r.ps(c, True), r.ps(c, False)
    assert full["args"] == ["secret prompt"] and full["limits"] == {"timeout": 5}
    assert "args" not in other and "limits" not in other
    assert {k: other[k] for k in ("lip", "user", "file", "state", "pid", "calls", "preds", "tokens")} == \
        {"lip": 3, "user": "alice", "file": "p.py", "state": "running", "pid": 7, "calls": 5, "preds": 2,
         "tokens": 40}


def test_serving_snapshot_stats_fields():
    s = ServingSnapshot(lips={1: LipCounters(1, 1, 1, 100), 2: LipCounters(0, 0, 0, 23)}, kv_pages_used=4,
                        kv_pages_total=10)
    st = s.as_stats()
    assert st["pending_reply_bytes"] == 123 and st["kv_pages_used"] == 4 and st["kv_pages_total"] == 10
    assert set(st) == {"batches", "batch_calls", "max_batch", "forward_passes", "pred_calls", "tokens_computed",
                       "engine_max_batch", "kv_pages_used", "kv_pages_total", "pending_reply_bytes",
                       "kv_device_free", "kv_reclaimable", "suspended_lips", "suspended_pages",
                       "suspensions", "resumes", "memory_waits", "kv_wait_failures", "host"}
    over = ServingSnapshot(suspended={3: 7, 4: 2}, overload={"suspensions": 5, "cache_drops": 1}).as_stats()
    assert over["suspended_lips"] == 2 and over["suspended_pages"] == 9
    assert over["suspensions"] == 5 and over["resumes"] == 0 and over["cache_drops"] == 1
    assert s.counters(3) == LipCounters()


# ---------------------------------------------------------------- one owner, many readers
def _check(snap) -> None:
    """What no published table may ever show."""
    live = [r.lip for r in snap.rows]
    assert len(live) == len(set(live)), live
    assert not set(live) & {r.lip for r, _ in snap.finished}
    for r in snap.rows:
        assert r.state in LIVE, r
        assert r.state != "running" or r.pid > 0, r
        assert r.state != "starting" or r.pid == 0, r
    for r, ev in snap.finished:
        assert r.state == "exited" and ev["lip"] == r.lip and ev["event"] == "exit"
    assert len(snap.finished) <= FINISHED_KEPT


def test_stats_during_a_stall_queue_one_publish_request_not_one_per_call():
    """`stats` asks the syscall thread to publish first; while the thread does not
    answer (a stall), every caller gives up after its wait and they all share
    ONE queued request; once it is answered, the next `stats` makes a new one."""
    import asyncio
    from concurrent.futures import Future
    from symphony.kernel.loop.status import FreshSnapshots

    class FakeSys:
        def __init__(self):
            self.requests = []

        def call_future(self, fn, anytime=False):
            f = Future()
            self.requests.append((f, fn))
            return f

    fake = FakeSys()
    fresh = FreshSnapshots(fake)

    async def flood():
        t0 = time.monotonic()
        await asyncio.gather(*[fresh.wait(0.05) for _ in range(200)])
        dt = time.monotonic() - t0
        assert len(fake.requests) == 1 and dt < 1.0, (len(fake.requests), dt)   # stalled: one request
        await fresh.wait(0.05)
        assert len(fake.requests) == 1                                            # still pending: shared
        f, fn = fake.requests[0]
        f.set_result(fn())                                                         # the thread answers
        await asyncio.sleep(0)
        await asyncio.gather(*[fresh.wait(0.05) for _ in range(3)])
        assert len(fake.requests) == 2                                            # a fresh one, shared by 3
    asyncio.run(flood())


def test_readers_in_other_threads_never_see_a_torn_table():
    t, stop, seen, errors = ProcessTable(), threading.Event(), [0], []

    def reader():
        last = -1
        try:
            while not stop.is_set():
                snap = t.snapshot
                _check(snap)
                assert snap.version >= last
                last = snap.version
                seen[0] += 1
        except BaseException as e:            # reported by the main thread
            errors.append(e)

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for r in readers:
        r.start()
    rnd, next_id, live = random.Random(7), 1, []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not errors:
        op = rnd.random()
        if op < 0.3 or not live:
            t.add(row(next_id, user=rnd.choice("abc")), ring=None)
            live.append(next_id)
            next_id += 1
            continue
        lip = rnd.choice(live)
        if op < 0.5:
            if (r := t.started(lip, 1000 + lip)) is not None:
                assert r.startswith("killed")
        elif op < 0.7:
            t.kill(lip, f"killed by {rnd.choice('abc')}")
        elif op < 0.85:
            t.exit_reported(lip)
        elif t.reclaimed(lip, 0, rnd.choice([0, 9]), LipCounters(1, 1, 1, 0)) is not None:
            live.remove(lip)
    stop.set()
    for r in readers:
        r.join()
    assert not errors, errors[0]
    assert next_id > 100 and seen[0] > 100, (next_id, seen[0])       # it really ran (a loaded box is slow)
    _check(t.snapshot)


# ---------------------------------------------------------------- the syscall thread's LIPs
def test_swap_out_first_names_only_blocked_lips_in_order():
    lips = ServedLips()
    now = time.monotonic()
    for i, (prio, recv, caps, since) in enumerate([(0, True, 0, now - 5), (0, False, 0, 0.0),
                                                    (5, False, 1, now - 1), (-5, True, 0, now - 1)], 1):
        lip = LipProc(i, "u", "p.py", [], None, {}, {}, priority=prio, caps_in_flight=caps, blocked_since=since)
        lip.parked_recv = (0, 1) if recv else None
        lips[i] = lip
    order = lips.swap_out_first()
    assert order == [4, 1, 3]                              # 2 is not blocked; lowest priority first


# ---------------------------------------------------------------- a real kernel
def test_ps_and_stats_hammered_while_lips_start_exit_and_die(fk):  # noqa: F811
    """Clients hammer ps and stats while others spawn LIPs that finish, send,
    decode until killed, or lose their client: no request fails, no reply
    shows a torn table, and once idle stats are exact."""
    base = fk.client().stats()
    stop, errors, replies = threading.Event(), [], [0]

    def hammer():
        c = fk.client(user="watcher")
        try:
            while not stop.is_set():
                ps, st = c.ps(), c.stats()
                ids = [l["lip"] for l in ps["lips"]]
                assert len(ids) == len(set(ids)) and not set(ids) & {f["lip"] for f in ps["finished"]}
                for l in ps["lips"]:
                    assert l["state"] in LIVE, l
                    assert l["state"] != "running" or l["pid"] > 0, l
                    assert l["user"] == "watcher" or "args" not in l     # others' arguments stay hidden
                for f in ps["finished"]:
                    assert f["state"] == "exited" and f["event"] == "exit", f
                assert 0 <= st["kv_pages_used"] <= st["kv_pages_total"] and st["lips"] >= 0
                replies[0] += 1
        except BaseException as e:
            errors.append(e)
        finally:
            c.close()

    hammers = [threading.Thread(target=hammer) for _ in range(2)]
    for h in hammers:
        h.start()
    try:
        for _ in range(4):
            started = []
            for mode in ("quick", "send", "decode", "decode"):
                c = fk.client(user="churn", timeout=60)
                started.append((c, c.spawn(WORKER, [mode], filename=f"fault_{mode}.py"), mode))
            time.sleep(0.3)
            gone = set()
            for i, (c, lip, mode) in enumerate(started):
                if mode == "decode" and i % 2:
                    c.close()                               # its client goes: the LIP is killed
                    gone.add(lip)
                elif mode == "decode":
                    with fk.client(user="churn") as k:
                        k.kill(lip)
            for c, lip, mode in started:
                if lip not in gone:
                    ev = [e for e in c.events(timeout=60) if e["event"] == "exit"]
                    assert len(ev) == 1, (mode, ev)
                    c.close()
    finally:
        stop.set()
        for h in hammers:
            h.join(30)
    assert not errors, errors[0]
    assert replies[0] > 10
    deadline = time.time() + 30
    while time.time() < deadline:
        st, ps = fk.client().stats(), fk.client().ps()
        if st["lips"] == 0 and st["kv_pages_used"] == base["kv_pages_used"]:
            break
        time.sleep(0.2)
    assert st["lips"] == 0 and ps["lips"] == [] and st["kv_pages_used"] == base["kv_pages_used"], st
    assert st["pred_calls"] > base["pred_calls"]
    decoded = [f for f in ps["finished"] if f["user"] == "churn" and f["file"] == "fault_decode.py"]
    assert decoded and all(f["calls"] >= f["preds"] >= 0 for f in decoded), decoded
    assert any(f["preds"] > 0 for f in decoded), decoded       # their last counters, kept after the reclaim


# ---------------------------------------------------------------- the syscall thread's snapshot
@pytest.fixture
def served_server(tiny_weights):
    from symphony.engine.config import EngineConfig
    from symphony.engine.engine import Engine
    from symphony.ipc.wait import WaitSet
    from symphony.kernel.syscall.server import SyscallServer
    from symphony.kvfs import KVFS, KVFSConfig
    eng = Engine(tiny_weights, None, EngineConfig(page_size=4, num_pages=32))
    served = ServedLips()
    fs = KVFS(eng, KVFSConfig(host_pages=5), evict_first=served.swap_out_first)
    door = WaitSet()
    srv = SyscallServer(eng, fs, door, lambda *a: None, lambda *a: None, lips=served)
    srv.thread.start()
    yield eng, fs, served, srv
    srv.stop.set()
    door.ring()
    srv.thread.join(5)
    door.close()


def test_the_syscall_thread_publishes_what_it_serves(served_server):
    eng, fs, served, srv = served_server
    alloc = eng.kv.allocator
    assert fs.evict_first == served.swap_out_first and srv.lips is served      # the callback came in the constructor
    s0 = srv.snapshot
    assert (s0.kv_pages_used, s0.kv_pages_total, s0.kv_pages_free) == (0, alloc.capacity, alloc.capacity + 5)
    pages = srv.call(lambda: alloc.allocate(3))                                  # an awaited command: published at once
    s1 = srv.snapshot
    assert s1 is not s0 and (s1.kv_pages_used, s1.kv_pages_free) == (3, alloc.capacity + 2)
    assert s0.kv_pages_used == 0                                                 # the old one never changes
    srv.submit(lambda: alloc.free(pages))                                        # not awaited: published soon after
    deadline = time.monotonic() + 2
    while srv.snapshot.kv_pages_used != 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert srv.snapshot.kv_pages_used == 0


def test_a_kernel_refuses_an_fs_without_its_lips_callback(tiny_weights):
    from symphony.engine.config import EngineConfig
    from symphony.engine.engine import Engine
    from symphony.kernel.daemon import Kernel
    from symphony.kvfs import KVFS
    eng = Engine(tiny_weights, None, EngineConfig(page_size=4, num_pages=16))
    with pytest.raises(ValueError, match="evict_first"):
        Kernel(eng, KVFS(eng), "/nonexistent/sock", served=ServedLips())
    served = ServedLips()
    with pytest.raises(ValueError, match="pinned"):          # running LIPs must be pinned too
        Kernel(eng, KVFS(eng, evict_first=served.swap_out_first), "/nonexistent/sock", served=served)
