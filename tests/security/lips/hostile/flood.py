"""Floods the kernel with system calls from 8 threads for a few seconds."""
import threading
import time

from symphony.lip import kv, send


def main(seconds="4"):
    stop = time.time() + float(seconds)
    count = [0] * 8

    def hammer(i):
        while time.time() < stop:
            try:
                kv.stat("/shared")
            except Exception:
                pass
            count[i] += 1
    ts = [threading.Thread(target=hammer, args=(i,)) for i in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    send(f"flooded {sum(count)} calls\n")
