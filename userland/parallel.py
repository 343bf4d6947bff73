"""Prefix caching + parallel decoding (the second example of the design).

The system prompt's KV is computed once and kept as /shared/parallel-sys.kv;
each question forks it (copy-on-write) and decodes in its own thread, and the
threads' pred() calls share the kernel's batches.

    symphony run userland/parallel.py "Question one?" "Question two?" ...
"""
from concurrent.futures import ThreadPoolExecutor

from symphony.lip import AlreadyExists, NotFound, kv, pred, send, tokenizer

PREFIX = "/shared/parallel-sys.kv"
SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one sentence."}


def shared_prefix(tok):
    try:
        return kv.open(PREFIX)
    except NotFound:
        try:
            with kv.create(PREFIX, mode=0o644) as f:
                pred(f, tok.encode_chat([SYSTEM], add_generation_prompt=False))
        except AlreadyExists:
            pass                                             # another LIP made it first
        return kv.open(PREFIX)


def answer(tok, prefix, i, question, max_tokens):
    full = tok.encode_chat([SYSTEM, {"role": "user", "content": question}])
    t, out = full[len(tok.encode_chat([SYSTEM], add_generation_prompt=False)):], []
    with prefix.fork() as f:                                 # shares every prefix page
        for _ in range(max_tokens):
            t = pred(f, t, output="argmax")
            if t in tok.eos_ids:
                break
            out.append(t)
            t = [t]
    send({"question": i, "answer": tok.decode(out)})


def main(*questions, max_tokens=48):
    tok = tokenizer()
    prefix = shared_prefix(tok)
    with ThreadPoolExecutor(max_workers=len(questions) or 1) as pool:
        list(pool.map(lambda iq: answer(tok, prefix, *iq, max_tokens), enumerate(questions)))
    prefix.close()
