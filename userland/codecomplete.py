"""Next-line code completion with one KV file per source file.

    symphony run --grant read:ROOT userland/codecomplete.py [--root ROOT] --file pkg/x.py --line N
        [--event complete|edit|delete]
    symphony run --grant read:ROOT userland/codecomplete.py [--root ROOT]      (interactive)
        stdin: one JSON request a line, {"file": "pkg/x.py", "line": N, "event": "complete"}

"complete" suggests the line after line N (greedy, until a newline) from the
file's lines 1..N; "edit" (the file changed on disk) only brings the KV up to
date; "delete" (the file is gone) retires its KV.  Each request is answered
with one JSON object: the completion and the prefill tokens computed / reused.

The KV of a file's lines 1..N lives in /home/<user>/code/<file>.kv and outlives
the LIP.  Each line is tokenized on its own (with its leading newline), so the
tokens of a line depend only on that line: the KV's longest unchanged token
prefix is the tokens of the unchanged leading lines.  Which lines the KV holds
is recorded next to it, as empty KV files named after each line's hash:
/home/<user>/code/<file>.lines/<i>-<hash>.  On a request the program compares
them with the file on disk, truncates the KV after the last unchanged line and
appends only the rest (a file that changed near its end costs a few tokens).

On delete, <file>.kv and its line list are renamed to <file>.prev.kv /
<file>.prev.lines, advised "drop_first" and to expire after 30 s: if the file
comes back within that time (an undo), its KV is restored instead of
recomputed.
"""
import hashlib
import json
import re

from symphony.lip import AlreadyExists, NotFound, SyscallError, info, kv, pred, read_file, recv, send, tokenizer

MAX_TOKENS, UNDO_SECONDS = 48, 30
NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")


def digest(s):
    return hashlib.sha1(s.encode()).hexdigest()[:12]


def kv_base(file):
    """/home/<user>/code/<file>, each path component a valid KVFS name."""
    parts = [p if NAME.fullmatch(p) and p not in (".", "..") else "x-" + digest(p)
             for p in file.split("/") if p not in ("", ".")]
    return f"/home/{info()['user']}/code/" + "/".join(parts)


def mkdirs(path):
    parts = path.strip("/").split("/")
    for i in range(3, len(parts)):                 # the parents of path; /home/<user> exists
        try:
            kv.mkdir("/" + "/".join(parts[:i]))
        except AlreadyExists:
            pass


def listing(d):
    try:
        return sorted((e["name"] for e in kv.list(d)), key=lambda n: int(n.split("-")[0]))
    except NotFound:
        return []


def rmtree(d):
    for name in listing(d):
        kv.remove(f"{d}/{name}")
    try:
        kv.rmdir(d)
    except NotFound:
        pass


def restore(base):
    """The file is back within UNDO_SECONDS of its deletion: its previous KV becomes current."""
    try:
        prev = kv.open(base + ".prev.kv")
    except NotFound:                               # never deleted, or expired: forget its lines
        rmtree(base + ".prev.lines")
        return
    with prev, prev.fork(base + ".kv") as f:       # a fork does not inherit the expiry
        f.advise("normal")
    kv.remove(base + ".prev.kv")
    rmtree(base + ".lines")
    try:
        kv.rename(base + ".prev.lines", base + ".lines")
    except NotFound:                               # no line list: the KV is recomputed
        pass


def sync(base, text, n):
    """Make <base>.kv hold the tokens of lines 1..n of ``text``, reusing its
    longest unchanged prefix.  Returns (the open file, token ids, reused, computed)."""
    tok = tokenizer()
    lines = text.split("\n")[:n]
    ids = [tok.encode(("\n" if i else "") + line) for i, line in enumerate(lines)]
    sigs = [f"{i}-{digest(line)}" for i, line in enumerate(lines)]
    try:
        f = kv.open(base + ".kv", "rw")
    except NotFound:
        mkdirs(base)
        restore(base)
        try:
            f = kv.open(base + ".kv", "rw")
        except NotFound:
            f = kv.create(base + ".kv")
    old = listing(base + ".lines")
    d = 0
    while d < min(len(old), len(sigs)) and old[d] == sigs[d]:
        d += 1
    keep = sum(map(len, ids[:d]))
    if len(f) < keep:                              # the KV and its line list disagree: start over
        d, keep = 0, 0
    for name in old[d:]:
        kv.remove(f"{base}.lines/{name}")
    f.truncate(keep)
    new = [t for chunk in ids[d:] for t in chunk]
    if new:
        pred(f, new, output="argmax")
    try:
        kv.mkdir(base + ".lines")
    except AlreadyExists:
        pass
    for name in sigs[d:]:
        kv.create(f"{base}.lines/{name}").close()
    return f, [t for chunk in ids for t in chunk], keep, len(new)


def complete(f, ids):
    """Greedy continuation of ``f`` (holding ``ids``) up to the end of the next line."""
    tok = tokenizer()
    if not ids:
        return "", 0
    out = []
    with f.fork() as g:                            # the file itself keeps only the source
        g.truncate(len(ids) - 1)                   # logits come from a pred: feed the last token again
        t = pred(g, ids[-1:], output="argmax")
        for _ in range(MAX_TOKENS):
            if t in tok.eos_ids:
                break
            out.append(t)
            if "\n" in tok.decode(out).lstrip("\n"):
                break
            t = pred(g, [t], output="argmax")
    return tok.decode(out).lstrip("\n").split("\n")[0], 1


def delete(base):
    rmtree(base + ".prev.lines")
    try:
        kv.remove(base + ".prev.kv")               # an older undo copy
    except NotFound:
        pass
    try:
        kv.rename(base + ".kv", base + ".prev.kv")
    except NotFound:
        return False
    with kv.open(base + ".prev.kv") as p:
        p.advise("drop_first")                     # evicted first if memory is short
        p.advise("expire", UNDO_SECONDS)           # and gone from the namespace soon
    try:
        kv.rename(base + ".lines", base + ".prev.lines")
    except NotFound:
        pass
    return True


def handle(root, req):
    file, event = req["file"], req.get("event", "complete")
    base = kv_base(file)
    out = {"file": file, "event": event}
    if event == "delete":
        out["kv"] = base + ".prev.kv" if delete(base) else None
        return out
    if event not in ("edit", "complete"):
        raise ValueError(f"unknown event {event!r} (complete, edit, delete)")
    text = read_file(f"{root}/{file}")
    n = int(req.get("line") or text.count("\n") + 1)
    f, ids, reused, computed = sync(base, text, n)
    if event == "complete":
        out["completion"], extra = complete(f, ids)
        computed += extra
    f.close()
    out.update(line=n, kv=base + ".kv", kv_tokens=len(ids), prefill_reused=reused, prefill_computed=computed)
    return out


def main(*args):
    opts, it = {"root": None, "file": None, "line": None, "event": "complete"}, iter(args)
    for a in it:
        if not (a.startswith("--") and a[2:] in opts):
            raise SystemExit(f"codecomplete: unexpected argument {a!r}")
        opts[a[2:]] = next(it, None)
    root = opts["root"]
    if root is None:
        grants = info()["grants"].get("read", [])
        if len(grants) != 1:
            raise SystemExit("codecomplete: pass --root DIR (and --grant read:DIR)")
        root = grants[0]
    if opts["file"]:                               # one request from the command line
        send(handle(root, opts))
        return
    for line in iter(recv, None):                  # interactive: one JSON request a line
        if line.strip():
            try:
                send(handle(root, json.loads(line)))
            except (SyscallError, ValueError, KeyError, TypeError) as e:
                send({"error": f"{type(e).__name__}: {e}"})
