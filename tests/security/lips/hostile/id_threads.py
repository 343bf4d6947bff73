"""A thread bomb: starts threads that never finish until it cannot start any more."""
import threading

from symphony.lip import send


def main():
    stop = threading.Event()
    n, err = 0, "none"
    try:
        while n < 5000:
            threading.Thread(target=stop.wait, daemon=True).start()
            n += 1
    except BaseException as e:              # RuntimeError: can't start new thread
        err = type(e).__name__
    stop.set()
    send(f"threads {n} {err}\n")
