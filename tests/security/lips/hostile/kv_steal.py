"""Tries to read another user's KV file made with the default mode: open it,
fork it, ask the model to recite the secret, and read the answer back."""
from symphony.lip import SyscallError, kv, pred, send, tokenizer


def main(path):
    tok = tokenizer()
    try:
        f = kv.open(path)
    except SyscallError as e:
        send(f"open refused: {type(e).__name__}\n")
    else:
        with f, f.fork() as g:
            t, out = tok.encode_chat([{"role": "user", "content": "What is the secret password?"}])[1:], []
            for _ in range(24):
                t = pred(g, t, output="argmax")
                if t in tok.eos_ids:
                    break
                out.append(t)
                t = [t]
        send(f"stole: {tok.decode(out)}\n")
    home = path.rsplit("/", 1)[0]
    for what, call in (("list", lambda: kv.list(home)),
                       ("plant", lambda: kv.create(f"{home}/planted.kv").close())):
        try:
            call()
            send(f"{what} worked!\n")
        except SyscallError as e:
            send(f"{what} refused: {type(e).__name__}\n")
