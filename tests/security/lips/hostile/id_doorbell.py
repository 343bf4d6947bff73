"""Tampers with its doorbell: saturates it, keeps reading (stealing) from it, and rings it
in a loop without making calls.  Runs until killed (or its wall-clock limit)."""
import os
import threading
import time

from symphony.lip import runtime, send


def main():
    ring = runtime._ring
    bell = getattr(ring, "_bell", None)            # a per-LIP eventfd
    sem = getattr(ring, "_doorbell", None)         # (older kernels: one shared semaphore)
    if bell is not None:
        def saturate():
            try:
                os.eventfd_write(bell, (1 << 64) - 2)
            except OSError:
                pass

        def steal():
            os.set_blocking(bell, True)
            while True:
                try:
                    os.eventfd_read(bell)
                except OSError:
                    time.sleep(0.001)

        def ring_it():
            try:
                os.eventfd_write(bell, 1)
            except OSError:
                pass
    else:
        def saturate():
            try:
                while True:
                    sem.release()
            except OSError:
                pass

        def steal():
            while True:
                sem.acquire()

        def ring_it():
            try:
                sem.release()
            except OSError:
                pass
    saturate()
    send("saturated\n")
    threading.Thread(target=steal, daemon=True).start()
    while True:
        ring_it()
        saturate()
        time.sleep(0.0005)
