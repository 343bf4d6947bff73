"""Touches memory 64 MiB at a time until refused, then reports how much it got."""
from symphony.lip import send


def main():
    hog = []
    try:
        while True:
            b = bytearray(64 << 20)
            b[::4096] = b"\x01" * len(range(0, len(b), 4096))      # touch every page
            hog.append(b)
    except MemoryError:
        n = len(hog) * 64
        hog.clear()
        send(f"touched {n} MiB\n")
