"""Prints its whole environment (os.environ and the interpreter's start-up copy)."""
import os
import posix

from symphony.lip import send


def main():
    env = dict(os.environ)
    env.update({k.decode(errors="replace"): v.decode(errors="replace") for k, v in posix.environ.items()})
    for k in sorted(env):
        send(f"{k}={env[k]}\n")
    send("END\n")
