"""Reads one path N times while someone outside swaps it between a file inside the
grant and a symlink to a secret outside; counts what came back."""
from collections import Counter

from symphony.lip import errors, read_file, send


def main(path, n):
    seen = Counter()
    for _ in range(int(n)):
        try:
            seen[read_file(path)[:16]] += 1
        except errors.SyscallError as e:
            seen[f"refused {type(e).__name__}"] += 1
    send(dict(seen))
