"""Makes ``files`` named KV files of ``tokens`` tokens each, then syncs them to the
durable directory from one thread per file, over and over, until killed."""
import threading

from symphony.lip import info, kv, pred, send


def main(files="4", tokens="4000"):
    home = f"/home/{info()['user']}"
    fs = []
    for i in range(int(files)):
        f = kv.create(f"{home}/sync{i}.kv")
        for j in range(0, int(tokens), 500):
            pred(f, [(j + k) % 200 + 3 for k in range(500)])
        fs.append(f)
    send("ready\n")

    def loop(f):
        while True:
            f.sync()
    threads = [threading.Thread(target=loop, args=(f,)) for f in fs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
