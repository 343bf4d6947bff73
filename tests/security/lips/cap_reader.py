"""A well-behaved capability user: reads a granted file, reports it and how long
the call took; waits for a line of input (so its ring exists meanwhile); then
reads it again.  Args: path."""
import time

from symphony.lip import read_file, recv, send


def timed_read(path):
    t0 = time.monotonic()
    data = read_file(path)
    return {"data": data, "seconds": round(time.monotonic() - t0, 3)}


def main(path):
    send(timed_read(path))
    recv()
    send(timed_read(path))
