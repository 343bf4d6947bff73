"""A writer or a reader of chain files (tests/e2e/kernel/test_chain_lookup.py).

    chains.py claim-feed DIR N     claim the chain of N tokens, say "claimed", feed them on input, wait
    chains.py claim-hang DIR N     claim it, say "claimed", then never feed it (until killed or input)
    chains.py claim-die DIR N      claim it, say "claimed", then fail on input
    chains.py read DIR N WAIT      look it up (waiting up to WAIT s); send the length forked, the seconds
                                   waited and whether the next token equals a computation from scratch
"""
import time

from symphony.lip import AlreadyExists, kv, pred, recv, send
from symphony.lip.prefixcache import PrefixCache

BLOCK = 16


def tokens(n: int) -> list:
    return [(i * 7919) % 900 + 50 for i in range(n)]


def main(role, d, n, wait="0"):
    toks = tokens(int(n))
    keys = b"".join(PrefixCache(d, block=BLOCK, user="any").keys(toks, len(toks) // BLOCK))
    if role == "read":
        t0 = time.monotonic()
        f = kv.lookup(d, keys, BLOCK, wait=float(wait))
        waited, n = time.monotonic() - t0, len(f)
        got = pred(f, toks[n:] + [7], output="argmax")
        with kv.create() as g:
            want = pred(g, toks + [7], output="argmax")
        send({"length": n, "waited": waited, "same": got == want, "path": f.path})
        return 0
    try:
        kv.mkdir(d)
    except AlreadyExists:
        pass
    f = kv.lookup(d, keys, BLOCK, claim=True, ttl=600)
    send("claimed" if f.path else "not claimed")
    recv()
    if role == "claim-die":
        raise RuntimeError("the writer fails")
    if role == "claim-feed":
        pred(f, toks, output="argmax")
        send("fed")
        recv()
    return 0
