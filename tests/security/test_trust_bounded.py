"""Bounded everything: replies larger than a ring slot travel in
chunks, error messages are cut, one LIP's output is bounded by back-pressure,
sampling parameters are checked.  Each hostile LIP (tests/security/lips/hostile/bound_*)
runs beside a well-behaved one that must still answer."""
import hashlib
import threading
import time

import pytest

from conftest import BOB_UID, REPO, requires_root

HOSTILE = REPO / "tests/security/lips/hostile"
SLEEPER = "import time\n\ndef main(*args):\n    time.sleep(60)\n"


def _events_of(kernel, name, args=(), grants=None, user="mallory", timeout=120):
    """Run hostile LIP ``name`` beside the well-behaved one; (its events, the good run)."""
    c = kernel.client(user=user)
    c.spawn((HOSTILE / f"{name}.py").read_text(), list(args), filename=f"{name}.py", grants=grants)
    events = []
    t = threading.Thread(target=lambda: events.extend(c.events(timeout=timeout)))
    t.start()
    good = kernel.run(HOSTILE / "well_behaved.py")
    t.join(timeout)
    c.close()
    return events, good


def _out(events) -> str:
    return "".join(str(e.get("data", "")) for e in events if e.get("event") in ("out", "stdout", "stderr"))


def _check_good(kernel, good):
    assert good.returncode == 0 and "Paris" in good.stdout, (good.stdout, good.stderr[-2000:])
    assert kernel.proc.poll() is None, "the kernel died"


def test_errors_larger_than_a_slot_are_truncated_not_fatal(kernel):
    events, good = _events_of(kernel, "bound_bigerror")
    _check_good(kernel, good)
    out = _out(events)
    assert events[-1]["reason"] == "finished", (events[-1], out[-500:])
    for kind, start in (("PermissionDenied", "/nowhere/xxx"), ("InvalidArgument", "n_tokens mus")):
        line = [l for l in out.splitlines() if l.startswith(kind)]
        assert line, out[-500:]
        n = int(line[0].split()[1])
        assert n < 4200, line
        if kind == "InvalidArgument" or "truncated=True" in line[0]:   # quoted: then truncated, with the marker
            assert "truncated=True" in line[0] and start in line[0], line
        else:                                                          # refused without quoting the path
            assert "path must be" in line[0], line


def test_replies_larger_than_a_slot_arrive_whole(kernel, public_tmp):
    d = public_tmp                    # "mallory" has no account: files are read with nobody's rights
    text = "".join(f"line {i:06d} of a long file, with some words to fill it up\n" for i in range(3600))
    assert len(text) > 200_000
    (d / "big.txt").write_text(text)
    listing = d / "many"
    listing.mkdir()
    names = sorted(f"{i:05d}-" + "n" * 90 for i in range(2200))         # ~210 KB of names
    for n in names:
        (listing / n).touch()
    events, good = _events_of(kernel, "bound_bigreply", [str(d / "big.txt"), str(listing)],
                              grants={"read": [str(d)]})
    _check_good(kernel, good)
    out = _out(events)
    assert events[-1]["reason"] == "finished", (events[-1], out[-800:])
    assert f"read {len(text)} {hashlib.sha256(text.encode()).hexdigest()}" in out, out[-800:]
    assert f"listed {len(names)} {hashlib.sha256(chr(10).join(names).encode()).hexdigest()}" in out, out[-800:]
    assert kernel.client().stats()["pending_reply_bytes"] == 0


def test_sampling_parameters_are_checked(kernel):
    events, good = _events_of(kernel, "bound_sampling")
    _check_good(kernel, good)
    out = _out(events)
    assert events[-1]["reason"] == "finished", (events[-1], out[-800:])
    lines = out.splitlines()
    for name in ("temperature=1e-300", "temperature=nan", "temperature=-1.0", "temperature=inf",
                 "top_p=0.0", "top_k=-3", "seed=abc", "min_p=-0.5", "min_p=nan"):
        line = next(l for l in lines if l.startswith(name + ":"))
        assert "InvalidArgument" in line and "internal error" not in line, line
        assert name.split("=")[0] + " must be" in line, line
    assert "[0.0001, 100.0]" in next(l for l in lines if l.startswith("temperature=1e-300"))
    valid = next(l for l in lines if l.startswith("valid sample"))
    assert valid.split()[4] == valid.split()[6], valid    # the refused calls fed nothing: only "Hello"


def _rss_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _lip_calls(kernel, lip):
    for l in kernel.client().ps()["lips"]:
        if l["lip"] == lip:
            return l["calls"]
    return None


def test_output_to_a_client_that_never_reads_is_bounded(kernel):
    from symphony.client import Client
    pid = kernel.proc.pid
    before = _rss_kb(pid)
    c = kernel.client(user="mallory")
    lip = c.spawn((HOSTILE / "bound_flood_out.py").read_text(), ["200"], filename="bound_flood_out.py")
    last, still = -1, 0
    deadline = time.time() + 60
    while time.time() < deadline and still < 4:              # until its send()s stop (or it ends)
        time.sleep(0.5)
        calls = _lip_calls(kernel, lip)
        still = still + 1 if calls == last else 0
        last = calls
    grown = _rss_kb(pid) - before
    st = kernel.client().stats()
    print(f"flood: {last} calls before send() waited; kernel RSS +{grown} KiB; "
          f"queued {st.get('output_queued_bytes')} B")
    good = kernel.run(HOSTILE / "well_behaved.py")           # the kernel still serves others
    _check_good(kernel, good)
    assert last is not None and last < 200, f"the LIP made {last} calls: its send()s did not wait"
    assert grown < 100 * 1024, f"the kernel grew by {grown} KiB"
    assert st["output_queued_bytes"] <= 1.2 * (1 << 20), st
    # now read: every byte arrives, in order, and the LIP finishes
    n, done = 0, None
    for ev in c.events(timeout=120):
        if ev.get("event") == "out":
            if ev["data"].startswith("done"):
                done = ev["data"]
            else:
                assert len(ev["data"]) == 60000
                n += 1
    assert done == f"done {n}\n" and n == 200_000_000 // 60000, (done, n)
    c.close()
    # a client that leaves without reading: its LIP is killed and the buffers go
    c = Client(kernel.socket, user="mallory")
    lip = c.spawn((HOSTILE / "bound_flood_out.py").read_text(), ["200"], filename="bound_flood_out.py")
    last, still = None, 0
    deadline = time.time() + 30
    while time.time() < deadline and still < 2:              # until its send()s wait: the buffers are full
        time.sleep(0.25)
        calls = _lip_calls(kernel, lip)
        still = still + 1 if calls and calls == last else 0
        last = calls
    assert still == 2 and kernel.client().stats()["output_queued_bytes"] > 0
    c.close()
    deadline = time.time() + 30
    while time.time() < deadline and _lip_calls(kernel, lip) is not None:
        time.sleep(0.2)
    assert _lip_calls(kernel, lip) is None
    assert kernel.client().stats()["output_queued_bytes"] == 0
    assert _rss_kb(pid) - before < 100 * 1024


def test_ps_hides_other_users_arguments(kernel):
    c = kernel.client(user="alice")
    lip = c.spawn(SLEEPER, ["my secret prompt"], filename="sleeper.py", limits={"timeout": 30})
    try:
        mine = next(l for l in kernel.client(user="alice").ps()["lips"] if l["lip"] == lip)
        assert mine["args"] == ["my secret prompt"]
        theirs = next(l for l in kernel.client(user="bob").ps()["lips"] if l["lip"] == lip)
        assert "args" not in theirs and theirs["user"] == "alice" and theirs["file"] == "sleeper.py"
        assert "my secret prompt" not in str(kernel.client(user="bob").ps())
        assert next(l for l in kernel.client().ps()["lips"] if l["lip"] == lip)["args"] == ["my secret prompt"]
    finally:
        c.kill(lip)
        c.close()


@requires_root
def test_ps_as_another_unix_user(kernel):
    c = kernel.client(user="alice")
    lip = c.spawn(SLEEPER, ["my secret prompt"], filename="sleeper.py", limits={"timeout": 30})
    try:
        with kernel.client_as(BOB_UID) as bob:
            r = bob.ps()
        assert "my secret prompt" not in str(r)
        theirs = next((l for l in r["lips"] if l["lip"] == lip), None)
        assert theirs is not None, (lip, r)
        assert "args" not in theirs and theirs["user"] == "alice"
    finally:
        c.kill(lip)
        c.close()


def test_cli_ps_prints_hidden_arguments(kernel):
    import subprocess
    import sys
    c = kernel.client(user="alice")
    lip = c.spawn(SLEEPER, ["my secret prompt"], filename="sleeper.py", limits={"timeout": 30})
    try:
        r = subprocess.run([sys.executable, "-m", "symphony.cli", "ps", "--as-user", "bob"], capture_output=True,
                           text=True, env=kernel.env, cwd=REPO, timeout=60)
        assert r.returncode == 0, r.stderr
        line = next(l for l in r.stdout.splitlines() if l.split()[0] == str(lip))
        assert "[args hidden]" in line and "secret" not in r.stdout
    finally:
        c.kill(lip)
        c.close()


# ---------------------------------------------------------------- the pieces alone (no kernel)
def test_reply_store_chunks_and_bounds():
    from symphony.kernel.syscall.replies import ReplyStore, truncate_message
    s = ReplyStore(limit=100)
    a = s.put(b"x" * 60)
    with pytest.raises(OverflowError, match="60 bytes of unfetched"):
        s.put(b"y" * 41)
    assert s.take(a, 0, 25) == b"x" * 25 and s.total == 60
    with pytest.raises(IndexError):
        s.take(a, 60, 25)
    assert s.take(a, 50, 25) == b"x" * 10 and s.total == 0      # the last byte frees it
    with pytest.raises(KeyError):
        s.take(a, 0, 25)
    assert truncate_message("ok") == "ok"
    m = truncate_message("é" * 5000, limit=10)
    assert m == "é" * 10 + "… [truncated, 10000 bytes]"


def test_sample_rejects_a_distribution_it_cannot_draw_from():
    import torch
    from symphony.engine.sampler import SamplingError, check_sampling, sample

    def _sample(x, b):
        return sample(x, check_sampling(b.get("temperature", 1.0), seed=b.get("seed")))
    x = torch.full((1, 8), float("-inf"))                        # [rows, vocab]: nothing allowed
    with pytest.raises(SamplingError, match="no valid distribution"):
        _sample(x, {"temperature": 1.0})
    x = torch.tensor([[0.0, 5.0, 1.0]])
    assert _sample(x, {"temperature": 0}).tolist() == [1]
    assert _sample(x, {"temperature": 1e-4, "seed": 3}).tolist() == [1]
    with pytest.raises(SamplingError, match="temperature must be"):
        _sample(x, {"temperature": 1e-300})
