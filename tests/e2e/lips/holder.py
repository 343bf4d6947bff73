"""Creates a named and an anonymous KV file, then waits for input lines and echoes them."""
from symphony.lip import info, kv, pred, recv, send, tokenize


def main(name):
    me = info()["user"]
    f = kv.create(f"/home/{me}/{name}", mode=0o600)
    pred(f, tokenize("a private document"))
    g = kv.create()
    pred(g, tokenize("anonymous scratch space"))
    send("ready\n")
    while (line := recv()) is not None:
        send(f"echo: {line}\n")
    f.close()
