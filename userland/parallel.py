"""Prefix caching + parallel decoding (the second example of the design).

The system prompt's KV is computed once and kept as /shared/parallel-sys.kv
(readable by every user); each question forks it (copy-on-write) and decodes in
its own thread, and the threads' pred() calls share the kernel's batches.

Anyone may create files in /shared, so the program uses the shared file only if
its owner is trusted (the user running it, or root), nobody else may write it
and it holds exactly the system prompt's tokens.  Otherwise (planted,
unreadable or half-written) it says so on stderr and uses
/home/<user>/parallel-sys.kv instead, or, failing that, computes the prompt in
an anonymous file: a foreign file is never forked.

    symphony run userland/parallel.py "Question one?" "Question two?" ...
"""
import sys
from concurrent.futures import ThreadPoolExecutor

from symphony.lip import (AlreadyExists, NotFound, PermissionDenied, SyscallError, info, kv, pred, send,
                          tokenizer)

PREFIX = "/shared/parallel-sys.kv"
SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one sentence."}
TRUSTED = {"root"}                                          # owners trusted besides the user


def warn(msg):
    print(f"parallel: {msg}", file=sys.stderr, flush=True)


def cached(path, tokens, mode):
    """``path`` opened read-only if it is (or, missing, can be made) a trusted
    copy of ``tokens``' KV; None otherwise.  A copy made here is always used
    (three tries: another user may make and remove the path between two of
    ours, but cannot remove ours), and one half made is removed."""
    me = info()["user"]
    for _ in range(3):
        try:
            f = kv.open(path)
        except PermissionDenied:
            warn(f"{path} exists but is not readable; not using it")
            return None
        except NotFound:
            try:
                f = kv.create(path, mode=mode)
            except AlreadyExists:
                continue                                     # another LIP made it first: check it
            except PermissionDenied as e:
                warn(f"cannot create {path}: {e}")
                return None
            try:
                pred(f, tokens)
            except SyscallError as e:                        # e.g. out of quota: leave nothing behind
                f.close()
                kv.remove(path)
                warn(f"cannot fill {path}: {e}")
                return None
            f.close()
            continue
        st = f.stat()                                        # the file this handle holds, not the path
        if st["owner"] not in TRUSTED | {me} or st["mode"] & 0o022:
            warn(f"ignoring {path}: owned by {st['owner']} with mode {st['mode']:o} (trusted: "
                 f"{', '.join(sorted(TRUSTED | {me}))}, writable only by its owner)")
        elif len(f) != len(tokens):
            warn(f"ignoring {path}: {len(f)} tokens, not the {len(tokens)} of the system prompt")
        else:
            return f
        f.close()
        return None
    return None


def shared_prefix(tok):
    tokens = tok.encode_chat([SYSTEM], add_generation_prompt=False)
    for path, mode in ((PREFIX, 0o644), (f"/home/{info()['user']}/parallel-sys.kv", None)):
        f = cached(path, tokens, mode)
        if f is not None:
            return f
    warn("computing the system prompt without a cache")
    f = kv.create()
    pred(f, tokens)
    return f


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
