"""A LIP for the fault tests: one kind of work, forever (or once), until killed.

    quick          exit at once, no system call
    send           send "hi", exit
    decode         greedy-decode forever (a short file, truncated back as it grows)
    fork           create, pred, fork, pred the fork, close both, again
    cap            read a granted file again and again (capability pool)
    eos            send what `symphony.lip.EOS` is and what the tokenizer says
"""
import sys

import symphony.lip
from symphony.lip import kv, pred, read_file, send, tokenizer


def main(mode="decode", path=""):
    if mode == "quick":
        return
    if mode == "send":
        send("hi")
        return
    if mode == "eos":
        from symphony.lip import EOS
        send({"eos": EOS, "attr": symphony.lip.EOS, "tokenizer": tokenizer().eos_id})
        return
    if mode == "decode":
        f = kv.create()
        t = [1, 2, 3]
        while True:
            t = [pred(f, t, output="argmax")]
            if len(f) > 48:
                f.truncate(3)
    if mode == "fork":
        while True:
            with kv.create() as f:
                pred(f, [1, 2, 3, 4, 5], output="argmax")
                with f.fork() as g:
                    pred(g, [6], output="argmax")
    if mode == "cap":
        while True:
            read_file(path)
    print(f"unknown mode {mode}", file=sys.stderr)
    sys.exit(2)
