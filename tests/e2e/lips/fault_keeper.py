"""A LIP that must survive the chaos: it keeps a named KV file and, on each
input line, checks that the file's KV is unchanged (the logits of one more
token on a fork are bit-identical to those taken at the start)."""
import numpy as np

from symphony.lip import kv, pred, recv, send


def main(path):
    f = kv.create(path)
    pred(f, list(range(1, 40)), output="argmax")
    with f.fork() as g:
        ref = np.array(pred(g, [7]), copy=True)
    length = len(f)
    send("ready")
    while (line := recv()) is not None:
        with f.fork() as g:
            now = np.array(pred(g, [7]), copy=True)
        send("same" if len(f) == length and np.array_equal(now, ref) else "changed")
