"""Keeps a secret prompt in a named KV file created with the default mode, then
echoes input lines until end of input (a well-behaved owner)."""
from symphony.lip import info, kv, pred, recv, send, tokenizer


def main(name, secret):
    tok = tokenizer()
    f = kv.create(f"/home/{info()['user']}/{name}")          # no mode: the default
    pred(f, tok.encode_chat([{"role": "system", "content": f"The secret password is {secret}."}],
                            add_generation_prompt=False))
    send("ready\n")
    while (line := recv()) is not None:
        send(f"echo: {line}\n")
    f.close()
