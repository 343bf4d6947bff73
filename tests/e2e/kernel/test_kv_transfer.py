"""KV files moved through the client RPC (kv_export / kv_import): symphony.client against real
kernels on tiny models.  A file exported and imported gives the logits of the original; the
reader's permission, the importer's quota, the checksum and the model are enforced with a
clear error that changes nothing, and a refused import leaves the connection usable.
(KVFS's side alone: tests/unit/kvfs/test_transfer.py; kernels behind a gateway moving a
drained or dead kernel's conversations: tests/e2e/gateway/test_gateway_remote.py.)"""
from __future__ import annotations

import hashlib

import pytest

from conftest import KernelProc, start_kernels, stop_kernels
from symphony.client import KernelError
from symphony.ipc import rpc
from symphony.ipc.protocol import recv_frame_sync, send_frame_sync

MAKE = '''from symphony.lip import kv, pred, send
def main(path):
    f = kv.create(path)
    pred(f, list(range(3, 45)))
    f.close()
    send("made")
'''
NEXT = '''from symphony.lip import kv, pred, send
def main(path):
    with kv.open(path) as f, f.fork() as g:
        send([round(float(x), 6) for x in pred(g, [7], output="topk", k=5)[1]])
'''


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    from modelfiles import write_tiny_gguf
    d = tmp_path_factory.mktemp("move")
    ks = start_kernels({"a": ((tmp_path_factory.mktemp("a"), "--model", str(write_tiny_gguf(d, seed=1)),
                               "--user-quota", "40"), {}),
                        "other": ((tmp_path_factory.mktemp("o"), "--model", str(write_tiny_gguf(tmp_path_factory.mktemp("m4"), seed=4))),
                                  {})})
    yield ks
    stop_kernels(ks)


def run(k: KernelProc, user: str, src: str, *args):
    with k.client(user=user) as c:
        c.spawn(src, list(args))
        evs = list(c.events())
    assert evs[-1]["status"] == 0, evs
    return [e["data"] for e in evs if e["event"] == "out"]


def test_an_exported_file_imported_gives_the_logits_of_the_original(kernels):
    a = kernels["a"]
    run(a, "alice", MAKE, "/home/alice/doc.kv")
    with a.client(user="alice") as c:
        blob = c.kv_export("/home/alice/doc.kv")
        got = c.kv_import("/home/alice/copy.kv", blob)
        assert got == {"path": "/home/alice/copy.kv", "length": 42, "pages": 3}
        assert c.kv_stat("/home/alice/copy.kv")["owner"] == "alice"
    assert run(a, "alice", NEXT, "/home/alice/doc.kv") == run(a, "alice", NEXT, "/home/alice/copy.kv")


def test_refusals_name_the_reason_and_change_nothing(kernels):
    a, other = kernels["a"], kernels["other"]
    run(a, "alice", MAKE, "/home/alice/mine.kv")
    with a.client(user="bob") as c:
        with pytest.raises(KernelError, match="bob may not open /home/alice/mine.kv") as e:
            c.kv_export("/home/alice/mine.kv")
        assert e.value.code == "EACCES"
    with a.client(user="alice") as c:
        blob = c.kv_export("/home/alice/mine.kv")
        with pytest.raises(KernelError, match="already exists"):
            c.kv_import("/home/alice/mine.kv", blob)
        bad = bytearray(blob)
        bad[len(bad) // 2] ^= 1
        with pytest.raises(KernelError, match="content hash mismatch") as e:
            c.kv_import("/home/alice/bad.kv", bytes(bad))
        assert e.value.code == "EBADMSG"
        with pytest.raises(KernelError, match="would hold"):      # 40 pages: 2 files of 3 held, 13 copies no
            for i in range(20):
                c.kv_import(f"/home/alice/n{i}.kv", blob)
    with other.client(user="alice") as c:
        with pytest.raises(KernelError, match="written by a different model") as e:
            c.kv_import("/home/alice/foreign.kv", blob)
        assert e.value.code == "EBADMSG"
        with pytest.raises(KernelError):
            c.kv_stat("/home/alice/foreign.kv")                   # nothing was made


def test_an_import_larger_than_the_quota_is_refused_before_its_data_and_the_connection_goes_on(kernels):
    a = kernels["a"]
    with a.client(user="alice") as c:
        size = 1 << 30
        chunks = -(-size // (4 << 20))
        send_frame_sync(c.sock, {"op": "kv_import", "path": "/home/alice/huge.kv", "size": size, "sha256": "0" * 64,
                                 "chunks": chunks, "user": "alice"})
        for i in range(chunks):                                     # what it announced, empty: read and dropped
            c.sock.sendall(rpc.RAW.to_bytes(4, "big"))
        reply = recv_frame_sync(c.sock)
        assert reply["error"] == "EDQUOT" and "free KV quota" in reply["message"], reply
        send_frame_sync(c.sock, {"op": "kv_import", "path": "/home/alice/x.kv", "size": 5, "sha256":
                                 hashlib.sha256(b"hello").hexdigest(), "chunks": 3, "user": "alice"})
        for i in range(3):
            c.sock.sendall((rpc.RAW | 5).to_bytes(4, "big") + b"hello")
        reply = recv_frame_sync(c.sock)
        assert reply["error"] == "EINVAL" and "comes in 1 chunks" in reply["message"], reply
        assert c.stats()["instance"]                                 # the stream is still in step
        send_frame_sync(c.sock, {"op": "kv_import", "path": "/home/alice/y.kv", "size": 5, "sha256":
                                 hashlib.sha256(b"hello").hexdigest(), "chunks": 1, "user": "alice"})
        send_frame_sync(c.sock, {"op": "ps"})                       # a JSON frame where KV data belongs
        assert recv_frame_sync(c.sock) is None                      # out of step: the kernel closed it
