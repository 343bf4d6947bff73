"""N threads, each forking one prefix and making exactly K decode steps."""
from concurrent.futures import ThreadPoolExecutor

from symphony.lip import kv, pred, tokenize


def main(n="4", k="10"):
    with kv.create() as prefix:
        pred(prefix, tokenize("Once upon a time, in a land far away,"))

        def worker(i):
            with prefix.fork() as f:
                t = tokenize(f" story {i}:")
                for _ in range(int(k)):
                    t = [pred(f, t, output="argmax")]
        with ThreadPoolExecutor(int(n)) as pool:
            list(pool.map(worker, range(int(n))))
