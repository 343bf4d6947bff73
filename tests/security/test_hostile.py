"""Hostile LIPs, each a real program, run beside a well-behaved LIP: each is
refused or killed with a clear reason, the well-behaved one finishes with the
right output, the kernel keeps running, and no shared memory is left behind."""
import threading
import time

import pytest

from conftest import REPO

HOSTILE = REPO / "tests/security/lips/hostile"

CASES = {
    # name: (limits, expected exit-reason substring or None, expected stderr/out substring)
    "network": ({}, "error", "PermissionError"),
    "exec": ({}, "error", "PermissionError"),
    "forkbomb": ({}, "error", "PermissionError"),
    "files": ({}, "error", "PermissionError"),
    "membomb": ({"memory_bytes": 512 << 20}, "error", "MemoryError"),
    "spin": ({"cpu_seconds": 1}, "CPU time limit", ""),
    "sleeper": ({"timeout": 1}, "wall-clock limit", ""),
    "crash": ({}, "signal 6", ""),
    "flood": ({}, "finished", "flooded"),
    "garbage": ({"timeout": 20}, "malformed system calls", ""),
    "quota": ({}, "finished", "quota stopped me after 2048 tokens"),
}


def run_beside_good(kernel, name, limits, args=(), user="mallory"):
    """Start the hostile LIP, run the good one while it misbehaves, collect both."""
    c = kernel.client(user=user)
    lip = c.spawn((HOSTILE / f"{name}.py").read_text(), list(args), filename=f"{name}.py", limits=limits)
    events = []
    t = threading.Thread(target=lambda: events.extend(c.events(timeout=90)))
    t.start()
    good = kernel.run(HOSTILE / "well_behaved.py")
    t.join(90)
    c.close()
    return lip, events, good


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_lip(kernel, name):
    limits, reason, text = CASES[name]
    lip, events, good = run_beside_good(kernel, name, limits)
    assert good.returncode == 0 and "Paris" in good.stdout, (good.stdout, good.stderr)
    assert events and events[-1]["event"] == "exit", events[-3:]
    exit_ev = events[-1]
    output = "".join(str(e.get("data", "")) for e in events)
    if reason is not None:
        assert reason in exit_ev["reason"], (exit_ev, output[-500:])
    else:
        assert exit_ev["status"] != 0 or "malformed" in exit_ev["reason"]
    assert text in output, output[-800:]
    time.sleep(0.1)
    assert not [n for n in kernel.shm_names() if f"sym{kernel.instance}_{lip}-" in n], "ring left behind"
    assert kernel.client().stats()["lips"] == 0
    assert kernel.proc.poll() is None, "the kernel died"


def test_reading_another_users_kv_file(kernel):
    owner = kernel.client(user="alice")
    holder = owner.spawn((REPO / "tests/e2e/lips/holder.py").read_text(), ["secret.kv"], filename="holder.py")
    assert next(owner.events(timeout=60)) == {"event": "out", "data": "ready\n"}
    r = kernel.run(HOSTILE / "snoop.py", "/home/alice/secret.kv", user="mallory")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["open refused", "guessed handles that worked: 0", "remove refused"]
    owner.send_input(holder, None)                       # let the holder finish
    assert [e for e in owner.events(timeout=30)][-1]["reason"] == "finished"
    st = kernel.client(user="alice").kv_stat("/home/alice/secret.kv")
    assert st["owner"] == "alice" and st["length"] > 0   # untouched
    kernel.client(user="alice").kv_rm("/home/alice/secret.kv")


def test_malformed_client_frames_do_not_hurt_the_kernel(kernel):
    import socket
    import struct
    s = socket.socket(socket.AF_UNIX)
    s.connect(kernel.socket)
    s.sendall(struct.pack(">I", 1 << 30))                # absurd frame length
    s.close()
    s = socket.socket(socket.AF_UNIX)
    s.connect(kernel.socket)
    s.sendall(struct.pack(">I", 5) + b"nojso")
    s.close()
    from symphony.ipc.protocol import recv_frame_sync, send_frame_sync
    from symphony.ipc.rpc import RpcError
    with pytest.raises(RpcError):                        # the client refuses to send it ...
        kernel.client().request({"op": "spawn", "source": 42})
    for bad, why in (({"op": "spawn", "source": 42}, "source"), ({"op": "format-disk"}, "unknown op")):
        s = socket.socket(socket.AF_UNIX)                # ... and the kernel, sent it raw, answers an error
        s.connect(kernel.socket)
        send_frame_sync(s, bad)
        reply = recv_frame_sync(s)
        s.close()
        assert "error" in reply and why in reply.get("message", ""), reply
    assert kernel.client().stats()["instance"] == kernel.instance      # still serving
