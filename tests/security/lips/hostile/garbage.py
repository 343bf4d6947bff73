"""Scribbles random bytes over its own shared-memory segment, then calls."""
import random

from symphony.lip import kv, runtime


def main():
    mm = runtime._ring._mm
    rng = random.Random(0)
    for _ in range(40):
        for _ in range(64):
            mm[rng.randrange(len(mm))] = rng.randrange(256)
        mm[64:96] = (1).to_bytes(4, "little") * 8        # every slot state word -> REQUEST
        try:
            kv.stat("/shared")
        except Exception:
            pass
