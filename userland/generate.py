"""Plain autoregressive decoding, streamed (the first example of the design).

    symphony run userland/generate.py "What is the capital of France?" [max_tokens]
"""
from symphony.lip import StreamDecoder, kv, pred, send, tokenizer


def main(question, max_tokens="128"):
    tok = tokenizer()
    out = StreamDecoder(tok)
    with kv.create() as f:                                   # anonymous KV file, freed on close
        t = tok.encode_chat([{"role": "user", "content": question}])
        for _ in range(int(max_tokens)):
            t = pred(f, t, output="argmax")                  # greedy token chosen in the kernel
            if t in tok.eos_ids:
                break
            send(out.push(t))
            t = [t]
    send(out.flush() + "\n")
