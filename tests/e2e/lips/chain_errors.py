"""Exercises bad chain-file calls (kv.lookup, f.publish); sends the exception type of each."""
from symphony.lip import errors, kv
from symphony.lip.prefixcache import PrefixCache
from symphony.lip.runtime import _call
from symphony.ipc import abi

import numpy as np

KEY = b"k" * 16


def attempt(name, fn):
    try:
        fn()
        send_(f"{name}: no error")
    except errors.SyscallError as e:
        send_(f"{name}: {type(e).__name__} {e.code}")


def send_(line):
    from symphony.lip import send
    send(line + "\n")


def main():
    kv.mkdir("/tmp/chain-errors")
    attempt("keys not 16 bytes", lambda: kv.lookup("/tmp/chain-errors", b"abc", 16))
    attempt("block not pages", lambda: kv.lookup("/tmp/chain-errors", KEY, 24))
    attempt("wait too long", lambda: kv.lookup("/tmp/chain-errors", KEY, 16, wait=1000))
    attempt("missing dir", lambda: kv.lookup("/tmp/chain-errors-none", KEY, 16))
    f = kv.create("/tmp/chain-errors/file")
    attempt("dir is a file", lambda: kv.lookup("/tmp/chain-errors/file", KEY, 16))
    attempt("bad path", lambda: kv.lookup("chain-errors", KEY, 16))
    attempt("keys and n_keys differ", lambda: _call(abi.KV_LOOKUP, {"dir": "/tmp/chain-errors", "block": 16,
                                                                    "n_keys": 2}, np.zeros(4, np.int32)))
    attempt("publish anonymous", lambda: kv.create().publish(KEY, 16))
    r = kv.open("/tmp/chain-errors/file", "r")
    attempt("publish read-only", lambda: r.publish(KEY, 16))
    attempt("publish bad block", lambda: f.publish(KEY, 8))
    attempt("publish", lambda: f.publish(KEY, 16))
    g = kv.lookup("/home", KEY, 16, claim=True)            # no write permission: an anonymous file
    send_(f"claim refused: {g.path} {len(g)}")
    h = kv.lookup("/tmp/chain-errors", b"", 16, claim=True)   # no keys: nothing to claim
    send_(f"no keys: {h.path} {len(h)}")
    long = [(i * 7919) % 900 + 50 for i in range(40000)]      # more blocks than a call takes keys
    pc = PrefixCache("/tmp/chain-errors", block=16, user="any")
    c, n = pc.open(long, limit=len(long) - 1, promise=len(long))
    send_(f"prompt over the keys a call takes: {n} {c.path is not None} "
          f"{pc.publish(c, long, len(long))}")
    c.remove()
    f.remove()
    r.close()
    kv.rmdir("/tmp/chain-errors")
    send_("done")
