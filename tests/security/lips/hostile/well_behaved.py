"""A normal LIP: greedy-decodes a fixed prompt and sends the text."""
from symphony.lip import kv, pred, send, tokenizer


def main():
    tok = tokenizer()
    with kv.create() as f:
        t, out = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]), []
        for _ in range(12):
            t = pred(f, t, output="argmax")
            if t in tok.eos_ids:
                break
            out.append(t)
            t = [t]
    send(tok.decode(out) + "\n")
