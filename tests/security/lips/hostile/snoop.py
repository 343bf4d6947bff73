"""Tries to read another user's private KV file, by path and by guessing handles."""
from symphony.lip import KVFile, errors, kv, pred, send


def main(path):
    try:
        kv.open(path)
        send("opened!\n")
    except errors.PermissionDenied:
        send("open refused\n")
    hits = 0
    for h in range(1, 200):
        try:
            pred(KVFile(h, None, True), [1])
            hits += 1
        except errors.BadHandle:
            pass
    send(f"guessed handles that worked: {hits}\n")
    try:
        kv.remove(path)
        send("removed!\n")
    except errors.PermissionDenied:
        send("remove refused\n")
