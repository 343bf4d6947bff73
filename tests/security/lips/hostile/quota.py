"""Allocates KV pages until the per-process quota stops it."""
from symphony.lip import errors, kv, pred, send


def main():
    f = kv.create()
    n = 0
    try:
        while True:
            pred(f, [1] * 512)
            n += 512
    except errors.QuotaExceeded as e:
        send(f"quota stopped me after {n} tokens: {e}\n")
