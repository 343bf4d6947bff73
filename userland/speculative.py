"""Speculative decoding with prompt-lookup drafts: greedy output, fewer pred calls.

    symphony run userland/speculative.py "prompt" [--max-tokens 128] [--ngram 3] [--draft 7] [--raw]

No draft model: the draft is copied from the context itself.  The last n-gram
of the context is looked up earlier in the context (longest n first, down to 1)
and the k tokens that followed it there are proposed.  One multi-token
``pred(f, [t] + draft, all_logits=True, output="argmax")`` then gives the
model's greedy choice after every draft position: the longest prefix of the
draft that matches is accepted, plus the model's own token at the first
mismatch (so every call yields at least one token), and ``f.truncate(n)``
rolls the KV file back over the rejected tail.  The draft length adapts (+2
after a fully accepted draft, -1 after a rejection, between 1 and --draft), so
text that does not repeat itself wastes little.  The output is the same as
plain greedy decoding (userland/generate.py); repetitive text (lists, code,
quoting the prompt) needs far fewer pred calls than tokens.

Sends the text (streamed), then one JSON line of stats.  ``--raw``: continue
the prompt as plain text instead of answering it as a chat message.
"""
from symphony.lip import StreamDecoder, kv, pred, send, tokenizer

MAX_DRAFT = 7          # draft + the pending token = 8 rows, the per-call logits limit


def parse(args):
    """"prompt" --max-tokens N --ngram N --draft N --raw -> (prompt, options)."""
    opts = {"max_tokens": 128, "ngram": 3, "draft": MAX_DRAFT, "raw": False}
    words, args = [], list(args)
    while args:
        a = args.pop(0)
        if a == "--raw":
            opts["raw"] = True
        elif a.startswith("--") and a[2:].replace("-", "_") in opts:
            opts[a[2:].replace("-", "_")] = int(args.pop(0))
        else:
            words.append(a)
    opts["draft"] = max(0, min(opts["draft"], MAX_DRAFT))
    return " ".join(words), opts


def lookup(ctx, ngram, k):
    """The k tokens that followed the latest earlier occurrence of ctx's last
    n-gram (n = ngram, ngram-1, ..., 1); [] if there is none."""
    for n in range(min(ngram, len(ctx) - 1), 0, -1):
        tail = ctx[-n:]
        for i in range(len(ctx) - n - 1, -1, -1):           # latest match first
            if ctx[i:i + n] == tail:
                return ctx[i + n:i + n + k]
    return []


def main(*args):
    prompt, o = parse(args)
    tok = tokenizer()
    eos = set(tok.eos_ids)
    ctx = tok.encode(prompt) if o["raw"] else tok.encode_chat([{"role": "user", "content": prompt}])
    out, stream = [], StreamDecoder(tok)
    calls = drafted = accepted = 0
    k = o["draft"]            # draft length: +2 after a fully accepted draft, -1 after a rejection
    with kv.create() as f:
        t = pred(f, ctx, output="argmax")                   # prefill; the first token
        calls += 1
        while t not in eos and len(out) < o["max_tokens"]:
            out.append(t)
            send(stream.push(t))
            room = o["max_tokens"] - len(out)                # never draft past the budget
            if room == 0:
                break
            draft = lookup(ctx + out, o["ngram"], min(k, room))
            # got[i] = the greedy token after [t] + draft[:i]: verify the whole draft at once
            got = pred(f, [t] + draft, all_logits=True, output="argmax")
            calls += 1
            a = 0
            while a < len(draft) and draft[a] == got[a] and draft[a] not in eos:
                a += 1
            if a < len(draft):
                f.truncate(len(f) - (len(draft) - a))       # roll back the rejected tail
            drafted, accepted = drafted + len(draft), accepted + a
            if draft:
                k = min(k + 2, o["draft"]) if a == len(draft) else max(1, k - 1)
            for d in draft[:a]:
                out.append(d)
                send(stream.push(d))
            t = got[a]                                       # the model's own next token
    send(stream.flush() + "\n")
    send({"pred_calls": calls, "tokens": len(out), "drafted": drafted, "accepted": accepted,
          "ids": out})
