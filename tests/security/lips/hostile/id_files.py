"""Looks at paths only root may see: stat, lstat, readlink, access, listdir."""
import os

from symphony.lip import send


def main(*paths):
    for p in paths:
        for how, fn in (("stat", os.stat), ("lstat", os.lstat), ("readlink", os.readlink),
                        ("exists", lambda q: os.path.exists(q) or (_ for _ in ()).throw(OSError())),
                        ("access", lambda q: os.access(q, os.F_OK) or (_ for _ in ()).throw(OSError())),
                        ("listdir", os.listdir)):
            try:
                r = fn(p)
                send(f"{how} {p} SEEN {str(r)[:80]}\n")
            except OSError:
                send(f"{how} {p} refused\n")
