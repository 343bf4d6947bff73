"""Retrieval-augmented answers with each document's KV kept as a file.

    symphony run --grant read:DOCS userland/rag.py [--docs DOCS] "question"
        [--k 2] [--doc NAME ...] [--max-tokens 32] [--no-cache] [--cache NAME]
        [--compose parallel|prefix]
        [--policy ttl [--keep-after 3] [--ttl 600] | --policy lfu --pin-tokens N]

Retrieval is BM25 over the text files of DOCS (read through the read_file /
list_dir capabilities); `--doc NAME` (repeated) skips it and uses the named
files of DOCS, in that order (a caller that retrieved them already).  The prompt is built from KV modules, Prompt Cache
style, each computed once and kept in KVFS, in the private cache of the user
running the program (/home/<user>/rag, or /home/<user>/NAME with --cache
NAME: separate caches with separate policies; only that user can write there,
so no other user can plant a module there):

    ~/rag/instr-<hash>.kv         the chat template's head and the system message,
                                  at positions 0..P-1
    ~/rag/<doc-hash>.kv           "Document: <text>" computed right after the
                                  instruction (it attended to it) and extracted:
                                  its own tokens at positions P..P+L-1
    ~/rag/hits/<doc-hash>.<t>.<n> an empty file whose name is the hit count n
                                  (t: the module's tokens)
    ~/rag/pinned/<doc-hash>.<t>   with --policy lfu: the document is pinned

A question merges [instruction, doc1, doc2, ...] (`kv.merge` keeps every
module at its own positions: the documents all start at P and do not see each
other) and appends the question at positions after the longest document.
With one document this is exactly the prompt computed in one pass; with more,
it is parallel context encoding (an approximation: the documents do not attend
to each other, and a small model's answers suffer; measured in
perf/paper/rag_skew.py).  `--compose prefix` is exact instead: only the first
document is a module; the others are computed after it, with the question.  A document's hash covers
the instruction's, so a new instruction never reuses stale modules.

Every module is a cache file (advise("cache")): when KV memory is short the
kernel may delete it while no LIP has it open, least recently used first; the
next question that needs it finds it gone (NotFound) and computes it again,
as a cache miss ("kv_created" counts it).
Policy: each use of a document counts a hit (the counter file is renamed
n -> n+1, an atomic step even with concurrent LIPs).  Two policies:
  ttl (default)  a document with at least --keep-after hits keeps its module
                 with no expiry (policy "keep": still a cache file, dropped
                 least recently used first under memory pressure); the others
                 get advise("expire", --ttl) again on every use (a sliding
                 lifetime).  A new advice replaces a pending expiry, so
                 promoting a document is one advise("cache").
  lfu            the most-hit documents whose modules fit in --pin-tokens
                 tokens are *pinned* (advise("keep"): never evicted nor
                 swapped, whatever else needs the memory); every other module is
                 a cache file, dropped least recently used first.  Each
                 question reconciles the pinned set (the markers in
                 ~/rag/pinned) with the hit counts: a document that drops out
                 of the most-hit is unpinned (a cache file again), one that
                 enters is pinned, so under concurrent questions the set is
                 right again at the next question.  The pinned modules hold KV
                 memory for good: size --pin-tokens well below the user's quota.

--no-cache computes the same modules as anonymous files every time: the same
tokens at the same positions, so the same answer, with nothing reused.
A module whose owner is not the user (only root could put one there) is not
used: it is recomputed, and stderr says so.
The answer is sent as text, then one JSON line of statistics: the documents
used, prefill tokens computed / reused, KV modules (instruction included)
created / reused, and the advice each document got.
"""
import hashlib
import math
import re
import sys
from collections import Counter

from symphony.lip import (AlreadyExists, NotFound, PermissionDenied, info, kv, list_dir, pred,
                          read_file, send, tokenizer)

SYSTEM = "Answer the question using the documents. Be brief."
STOP = set("a an the is are was were of in on at to for by with and or what who whom which how "
           "when where why does did do it its this that from as be".split())


def words(text):
    return [w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in STOP]


def bm25(query, docs, k1=1.5, b=0.75):
    """BM25 score of every document (a list of strings) for ``query``."""
    bags = [Counter(words(d)) for d in docs]
    avg = sum(sum(c.values()) for c in bags) / max(len(bags), 1) or 1
    df = Counter(w for c in bags for w in c)
    idf = {w: math.log(1 + (len(docs) - n + 0.5) / (n + 0.5)) for w, n in df.items()}
    q = set(words(query))
    return [sum(idf[w] * c[w] * (k1 + 1) / (c[w] + k1 * (1 - b + b * sum(c.values()) / avg))
                for w in q if w in c) for c in bags]


def parse(args):
    opts = {"docs": None, "k": "2", "keep-after": "3", "ttl": "600", "max-tokens": "32",
            "policy": "ttl", "pin-tokens": None, "cache": "rag", "compose": "parallel"}
    flags, rest, it, named = set(), [], iter(args), []
    for a in it:
        if a == "--no-cache":
            flags.add("no-cache")
        elif a == "--doc":
            named.append(next(it, None))
        elif a.startswith("--") and a[2:] in opts:
            opts[a[2:]] = next(it, None)
            if opts[a[2:]] is None:
                raise SystemExit(f"rag: {a} takes a value")
        elif a.startswith("--"):
            raise SystemExit(f"rag: unknown option {a}")
        else:
            rest.append(a)
    if len(rest) != 1 or None in named:
        raise SystemExit('usage: rag.py [--docs DIR] [--k N] [--doc NAME ...] [--no-cache] ... "question"')
    if any(not n or "/" in n for n in named):
        raise SystemExit(f"rag: --doc takes a file name in the documents' directory, got {named}")
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", opts["cache"]):
        raise SystemExit(f"rag: --cache takes a name of letters, digits, _ and -, got {opts['cache']!r}")
    if opts["compose"] not in ("parallel", "prefix"):
        raise SystemExit(f"rag: --compose is parallel or prefix, got {opts['compose']!r}")
    if opts["policy"] not in ("ttl", "lfu"):
        raise SystemExit(f"rag: --policy is ttl or lfu, got {opts['policy']!r}")
    if (opts["policy"] == "lfu") != (opts["pin-tokens"] is not None):
        raise SystemExit("rag: --pin-tokens N goes with --policy lfu (and only with it)")
    for key in ("k", "keep-after", "max-tokens") + (("pin-tokens",) if opts["pin-tokens"] is not None else ()):
        if not (opts[key] or "").isdigit():
            raise SystemExit(f"rag: --{key} takes a whole number >= 0, got {opts[key]!r}")
    return opts, flags, rest[0], named


def load_docs(d, named=()):
    """(names, texts) of the documents: those ``named`` (in that order), else every file of ``d``."""
    if d is None:                                  # default: the one directory granted to us
        grants = info()["grants"].get("read", [])
        if len(grants) != 1:
            raise SystemExit("rag: pass --docs DIR (and --grant read:DIR)")
        d = grants[0]
    names = list(named) or [n for n in list_dir(d) if not n.endswith("/")]
    return names, [read_file(f"{d}/{n}").strip() for n in names]


class Modules:
    """Named (or, without the cache, anonymous) KV modules, and what they cost."""

    def __init__(self, cache, name="rag"):
        self.cache, self.stats = cache, Counter()
        self.me = info()["user"]
        self.root = f"/home/{self.me}/{name}"
        self.hits = self.root + "/hits"
        if cache:
            for d in (self.root, self.hits):
                try:
                    kv.mkdir(d)                    # private (0700)
                except AlreadyExists:
                    pass

    def get(self, path, compute):
        """Open ``path`` or compute it with ``compute() -> (anonymous KVFile, tokens computed)``."""
        named = self.cache
        if self.cache:
            try:
                f = kv.open(path)
                owner = f.stat()["owner"]
                if owner == self.me:
                    self.stats["kv_reused"] += 1
                    self.stats["prefill_reused"] += len(f)
                    return f, False
                f.close()
                named = False                      # not ours: recompute, leave it alone
                print(f"rag: ignoring {path}: owned by {owner}, not {self.me}; recomputing",
                      file=sys.stderr, flush=True)
            except NotFound:
                pass
        f, n = compute()
        self.stats["prefill_computed"] += n
        if named:
            try:                                   # name it: fork shares the pages, copies nothing
                g = f.fork(path)
                f.close()
                g.advise("cache")                  # the kernel may drop it under memory pressure
                self.stats["kv_created"] += 1
                return g, True
            except (AlreadyExists, PermissionDenied):   # a concurrent LIP won / not our cache
                pass
        return f, True


def hit_counts(hits):
    """{"<doc-hash>.<tokens>": hits} from the counter files."""
    counts = {}
    for e in kv.list(hits):
        h, _, n = e["name"].rpartition(".")
        counts[h] = max(counts.get(h, 0), int(n))
    return counts


def count_hit(hits, h, counts):
    """Add one to document ``h``'s hit counter (in directory ``hits``); returns the new count."""
    for _ in range(16):
        n = counts.get(h, 0)
        try:
            if n == 0:
                kv.create(f"{hits}/{h}.1").close()
            else:
                kv.rename(f"{hits}/{h}.{n}", f"{hits}/{h}.{n + 1}")
            counts[h] = n + 1
            return n + 1
        except (AlreadyExists, NotFound):          # another LIP counted meanwhile: look again
            counts.update(hit_counts(hits))
    return counts.get(h, 0)


def apply_policy(f, hits, keep_after, ttl):
    """Keep a popular document's module (a cache file with no expiry), let the
    others expire; returns the policy applied."""
    f.advise("cache")                              # a cache file; this also ends a pending expiry
    if hits < keep_after:
        f.advise("expire", ttl)                    # unpopular: gone ttl seconds after its last use
        return "expire"
    return "keep"


def most_hit(counts, budget):
    """The documents to pin: the most-hit first (ties by name), each while the
    pinned modules' tokens stay within ``budget``."""
    chosen, used = set(), 0
    for key, _ in sorted(counts.items(), key=lambda kn: (-kn[1], kn[0])):
        t = int(key.rpartition(".")[2])
        if used + t <= budget:
            chosen.add(key)
            used += t
    return chosen


def reconcile_pins(mods, counts, budget):
    """Pin the most-hit documents' modules, unpin the rest (see the docstring)."""
    pins = mods.root + "/pinned"
    try:
        now = {e["name"] for e in kv.list(pins)}
    except NotFound:
        kv.mkdir(pins)
        now = set()
    want = most_hit(counts, budget)
    for key in now ^ want:
        pin = key in want
        try:
            with kv.open(f"{mods.root}/{key.rpartition('.')[0]}.kv") as f:
                if f.stat()["owner"] != mods.me:
                    continue
                f.advise("keep" if pin else "cache")
        except NotFound:                           # dropped before its pin: pinned when next computed
            if pin:
                continue
        except PermissionDenied:
            continue
        try:
            if pin:
                kv.create(f"{pins}/{key}").close()
            else:
                kv.remove(f"{pins}/{key}")
        except (AlreadyExists, NotFound):          # another question reconciled it meanwhile
            pass
    return want


def main(*args):
    opts, flags, question, named = parse(args)
    cache = "no-cache" not in flags
    tok = tokenizer()
    names, texts = load_docs(opts["docs"], named)
    if named:                                      # retrieved by the caller
        top = list(range(len(names)))
    else:
        scores = bm25(question, texts)
        top = sorted((i for i, s in enumerate(scores) if s > 0), key=lambda i: -scores[i])[:int(opts["k"])]

    # the prompt, cut into modules: head | Document: ... | Document: ... | Question: ... tail
    full = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\0"}])
    head, tail = full.split("\0")
    head_ids = tok.encode(head)
    ih = hashlib.sha256(head.encode()).hexdigest()[:16]
    mods = Modules(cache, opts["cache"])

    def compute_instruction():
        f = kv.create()
        pred(f, head_ids)
        return f, len(head_ids)
    instr, _ = mods.get(f"{mods.root}/instr-{ih}.kv", compute_instruction)

    docs, after = [], []                           # (hash, path, KVFile, tokens); tokens computed after them
    prefix = opts["compose"] == "prefix"
    for n, i in enumerate(top):
        ids = tok.encode(f"Document: {texts[i]}\n\n")
        if prefix and n > 0:                       # exact: computed after the first, never a module
            after += ids
            continue

        def compute_doc(ids=ids):
            with instr.fork() as g:                # after the instruction, then keep only the doc
                pred(g, ids)
                return g.extract([[len(head_ids), len(head_ids) + len(ids)]]), len(ids)
        dh = hashlib.sha256((ih + texts[i]).encode()).hexdigest()[:20]
        path = f"{mods.root}/{dh}.kv"
        docs.append((dh, path, mods.get(path, compute_doc)[0], len(ids)))

    q = after + tok.encode(f"Question: {question}" + tail)
    with kv.merge([instr] + [f for _, _, f, _ in docs]) as m:
        start = max([f.stat()["next_position"] for _, _, f, _ in docs] + [len(head_ids)])
        mods.stats["prefill_computed"] += len(q)
        t = pred(m, q, positions=list(range(start, start + len(q))), output="argmax")
        out = []
        for _ in range(int(opts["max-tokens"])):
            if t in tok.eos_ids:
                break
            out.append(t)
            t = pred(m, [t], output="argmax")
    send(tok.decode(out).strip() + "\n")

    policy = {}
    if cache:
        counts = hit_counts(mods.hits)
        lfu = opts["policy"] == "lfu"
        for dh, path, f, n in docs:
            if f.stat()["path"] != path:           # recomputed beside a foreign file: no policy
                continue
            try:
                hits = count_hit(mods.hits, f"{dh}.{n}", counts)
                policy[dh] = "counted" if lfu else apply_policy(f, hits, int(opts["keep-after"]),
                                                                float(opts["ttl"]))
            except (PermissionDenied, NotFound):   # someone else's cache: use it, leave its policy
                pass
        if lfu:
            pinned = reconcile_pins(mods, counts, int(opts["pin-tokens"]))
            for dh, _, f, n in docs:
                if dh in policy:
                    policy[dh] = "pin" if f"{dh}.{n}" in pinned else "cache"
                    if policy[dh] == "pin":        # pinned though recomputed (its marker outlived it)
                        f.advise("keep")
    for _, _, f, _ in docs:
        f.close()
    instr.close()
    send({"docs": [names[i] for i in top], "files": [p for _, p, _, _ in docs] if cache else [],
          "policy": policy,
          "prefill_computed": mods.stats["prefill_computed"],
          "prefill_reused": mods.stats["prefill_reused"],
          "kv_created": mods.stats["kv_created"], "kv_reused": mods.stats["kv_reused"]})
