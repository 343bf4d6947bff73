"""Reads a FIFO nobody writes to from several threads at once (on 04f0b73 each
call held a capability worker forever; four of them stopped every user's
capabilities).  Reports what each call got."""
import threading

from symphony.lip import errors, read_file, send


def main(path, n="6"):
    got = []

    def one():
        try:
            read_file(path)
            got.append("READ")
        except errors.SyscallError as e:
            got.append(f"refused {type(e).__name__}: {e}")
    ts = [threading.Thread(target=one) for _ in range(int(n))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    send({"got": got})
