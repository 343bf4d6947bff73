"""No user can exhaust the kernel's memory or descriptors, nor fill a shared bound for all.

Alice (an ordinary Unix user) attacks with what a client controls: huge
arguments, input a LIP never reads, frames she never finishes, thousands of
connections, queued programs, an impossible KV hint.  Bob's well-behaved LIP
is timed alone and during each attack (tests/security/isolation.py): same answer,
within 3x + 1 s, never refused; the kernel's RSS stays within the bound each
test states.  The bounds are set small here (``BOUNDS``) so that the attacks
stay short; the kernel's open-file limit is 1024."""
import os
import signal
import socket
import struct
import time

import pytest

from conftest import ALICE_UID, BOB_UID, requires_root
from .isolation import (end_all, SLEEPER, check_neighbour, fork_as, in_thread, neighbour, rss_mib, start_kernel,
                       wait_until)

BOUNDS = ("--max-args-kb 256 --max-queued-mb-per-user 4 --max-input-kb 256 --max-partial-mb-per-user 16 "
          "--max-connections-per-user 32").split()
RSS_BOUND_MIB = 96          # what one attack may add to the kernel's resident memory: a few 16 MiB frames
                            # (the one being read, its decoded copy) and what the allocator keeps of them

pytestmark = requires_root


@pytest.fixture(scope="module")
def mk(tmp_path_factory):
    k = start_kernel(tmp_path_factory, "isomem", "--max-lips-per-user", "4", "--max-queued-mb", "16", *BOUNDS,
                     nofile=1024)
    yield k
    k.stop()
    assert k.proc.returncode == 0, k.read_log()[-3000:]
    assert k.shm_names() == []


def test_arguments_are_bounded(mk):
    """24 LIPs with 8 MiB of arguments each grew the kernel by hundreds of MiB, and
    root's `ps` failed: its reply passed the client's 16 MiB frame limit."""
    from symphony.client import KernelError
    alone = neighbour(mk)
    rss0 = rss_mib(mk.proc.pid)
    refused = []
    with mk.client_as(ALICE_UID, timeout=60) as a:
        for _ in range(24):
            try:
                a.spawn(SLEEPER, ["x" * (8 << 20)], attach=False)
            except KernelError as e:
                refused.append(str(e))
        grown = rss_mib(mk.proc.pid) - rss0
        print(f"arguments: kernel RSS +{grown:.0f} MiB; {len(refused)} of 24 spawns refused")
        ps = mk.client().ps()                                   # root's: fits the client's frame limit
        check_neighbour(mk, alone, "arguments")
    end_all(mk)
    assert len(refused) == 24 and "--max-args-kb 256" in refused[0], refused[:1]
    assert grown < RSS_BOUND_MIB and isinstance(ps["lips"], list)


def test_one_user_cannot_fill_the_queue(mk):
    """Alice's queued programs filled the global --max-queued-mb: Bob's spawn was
    refused ("admission queue full")."""
    from symphony.client import KernelError
    alone = neighbour(mk)
    source = SLEEPER + "#" * (200 << 10)
    why = None
    with mk.client_as(ALICE_UID, timeout=60) as a:
        for _ in range(100):                                    # 4 run, the others wait
            try:
                a.spawn(source, attach=False)
            except KernelError as e:
                why = str(e)
                break
        check_neighbour(mk, alone, "queue")
    end_all(mk)
    assert why and "--max-queued-mb-per-user 4" in why, why


def test_unread_input_is_bounded(mk):
    """40 inputs of 8 MiB to a LIP that never calls recv() were all kept: +320 MiB."""
    alone = neighbour(mk)
    rss0 = rss_mib(mk.proc.pid)
    a = mk.client_as(ALICE_UID, timeout=60)
    lip = a.spawn(SLEEPER)
    sent = []

    def flood():
        try:
            for _ in range(40):
                a.send_input(lip, "y" * (8 << 20))
                sent.append(1)
        except OSError:
            pass
    in_thread(flood)
    time.sleep(3)
    grown = rss_mib(mk.proc.pid) - rss0
    print(f"input: {len(sent)} of 40 inputs taken; kernel RSS +{grown:.0f} MiB")
    st = mk.client().stats()
    check_neighbour(mk, alone, "input")
    a.close()                                                   # its LIP goes with it
    end_all(mk)
    assert grown < RSS_BOUND_MIB and len(sent) < 40
    assert st["input_queued_bytes"] <= 8 << 20, st


def _hold_partial_frames(path, n):
    """(as Alice) ``n`` connections, each sending all but the last byte of a 16 MiB frame."""
    import threading
    body = b"[" + b" " * ((16 << 20) - 3) + b"]"

    def one():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(struct.pack(">I", len(body)) + body[:-1])
        time.sleep(3600)
    for _ in range(n):
        threading.Thread(target=one, daemon=True).start()


def test_partial_frames_are_bounded(mk):
    """24 connections each holding 16 MiB minus a byte of a frame: +384 MiB."""
    alone = neighbour(mk)
    rss0 = rss_mib(mk.proc.pid)
    pid = fork_as(ALICE_UID, lambda: _hold_partial_frames(mk.socket, 24))
    try:
        time.sleep(4)
        grown = rss_mib(mk.proc.pid) - rss0
        print(f"partial frames: kernel RSS +{grown:.0f} MiB")
        check_neighbour(mk, alone, "partial frames")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert grown < RSS_BOUND_MIB


def _open_connections(path, n):
    keep = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        except OSError:
            s.close()
            continue
        keep.append(s)
    _open_connections.keep = keep


def test_connections_are_bounded(mk):
    """1,100 idle connections of one user took every descriptor of the kernel
    (1,024 here): every other user's connection then failed."""
    alone = neighbour(mk)
    rss0 = rss_mib(mk.proc.pid)
    pid = fork_as(ALICE_UID, lambda: _open_connections(mk.socket, 1100))
    try:
        time.sleep(2)                                           # the flood is refused (and the backlog drains)
        print(f"connections: kernel RSS +{rss_mib(mk.proc.pid) - rss0:.0f} MiB")
        check_neighbour(mk, alone, "connections")
        st = mk.client().stats()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert st["connections"] <= 32 + 4, st
    assert "too many connections: uid 2101 has 32 open" in mk.read_log()


def test_a_kv_tokens_hint_cannot_reserve_the_device(mk):
    """A LIP's --kv-tokens 1073741824 made admission count 67 million pages
    reserved: every later LIP of every user waited forever."""
    from symphony.client import KernelError
    alone = neighbour(mk)
    with mk.client_as(ALICE_UID, timeout=60) as a:
        with pytest.raises(KernelError, match=r"kv_tokens 1073741824 is more than the device KV pool can ever "
                                              r"hold \(8176 tokens\)"):
            a.launch(SLEEPER, kv_tokens=1 << 30)
        for _ in range(3):                                      # the whole device, three times over
            assert a.launch(SLEEPER, kv_tokens=8176, attach=False)["event"] in ("started", "queued")
        check_neighbour(mk, alone, "kv_tokens")
    end_all(mk)
