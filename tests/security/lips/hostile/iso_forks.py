"""Makes one file of ``tokens`` tokens and forks it ``n`` times, keeping every fork
open, then waits until killed (or told to stop on its input)."""
from symphony.lip import SyscallError, kv, pred, recv, send


def main(tokens="4000", n="4000"):
    f = kv.create()
    for j in range(0, int(tokens), 500):
        pred(f, [(j + k) % 200 + 3 for k in range(500)])
    forks = []
    try:
        for _ in range(int(n)):
            forks.append(f.fork())
    except SyscallError as e:
        send(f"stopped after {len(forks)} forks: {type(e).__name__}: {e}\n")
    send(f"holding {len(forks)} forks\n")
    recv()
