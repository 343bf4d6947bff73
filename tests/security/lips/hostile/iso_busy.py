"""Two (or ``threads``) threads of pure-Python busy work, forever."""
import threading


def spin():
    x = 0
    while True:
        x = (x * 31 + 7) % 1000003


def main(threads="2"):
    ts = [threading.Thread(target=spin) for _ in range(int(threads))]
    for t in ts:
        t.start()
    spin()
