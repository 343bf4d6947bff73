"""Fills a directory with ``n`` empty named KV files (for listings), then waits."""
from symphony.lip import info, kv, recv, send


def main(n="9000"):
    d = f"/home/{info()['user']}/big"
    kv.mkdir(d)
    for i in range(int(n)):
        kv.create(f"{d}/file-{i:05d}-with-a-longer-name.kv").close()
    send(f"made {d}\n")
    recv()
