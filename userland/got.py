"""Graph of thoughts: branch, score, keep the best, merge their KV, conclude.

    symphony run userland/got.py "problem" [--thoughts 4] [--keep 2] [--max-tokens 48] [--seed 0] [--exact]

1. Branch: the problem's prompt is computed once into a KV file; each thought
   forks it (copy-on-write: the prompt's pages are shared) and is sampled in
   its own thread with its own seed, opened by "Thought i:".
2. Score: the model grades each thought itself: on a fork of the thought's
   file, the chat turn "Is this thought correct? Answer Yes or No." is
   appended and the score is log P("Yes") of the reply's first token.
3. Aggregate: the --keep best thoughts are cut out of their files
   (`f.extract`, no recomputation) and `kv.merge`d after the problem's KV:
   [problem | thought a | thought b].  Each thought keeps its positions, so
   the thoughts sit side by side after the problem, each seeing only the
   problem (Prompt Cache style modules); the conclusion is placed after the
   longest of them.  This is an approximation: in the merged file thought b
   never saw thought a, as it would in a prompt that lists them.  ``--exact``
   computes what a prompt-serving client computes instead: a fork of the
   problem's file is fed "Thought a: ...\nThought b: ...\n" as text (the
   problem is not recomputed; the kept thoughts are, in order).
4. Conclude: "Final answer:" is appended to the merged file and decoded greedily.

Sends one JSON object: the thoughts with their scores, the kept ones, the
merged file's length and its parts' lengths (with ``--exact``: the length of
the file the conclusion was decoded from, and [problem, the rest]), the final
answer, ``exact``, and ``generated``: the tokens the model decoded (each
thought's, its closing newline included, and the answer's).
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from symphony.lip import kv, pred, send, tokenizer

VERIFY = "Is this thought correct? Answer Yes or No."


def parse(args):
    opts = {"thoughts": 4, "keep": 2, "max_tokens": 48, "seed": 0, "exact": 0}
    words, args = [], list(args)
    while args:
        a = args.pop(0)
        if a == "--exact":
            opts["exact"] = 1
        elif a.startswith("--") and a[2:].replace("-", "_") in opts:
            opts[a[2:].replace("-", "_")] = int(args.pop(0))
        else:
            words.append(a)
    opts["thoughts"] = max(1, min(opts["thoughts"], 8))     # 8 system-call slots per LIP
    opts["keep"] = max(1, min(opts["keep"], opts["thoughts"]))
    return " ".join(words), opts


def reply_then_ask(tok, question):
    """The chat template's text that closes an assistant reply and asks `question`
    in a new user turn, up to the next assistant reply (e.g. for SmolLM2:
    '<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n')."""
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "@@"}]
    a = tok.apply_chat_template(msgs, add_generation_prompt=False)
    b = tok.apply_chat_template(msgs + [{"role": "user", "content": question}])
    return b[a.index("@@") + 2:]


def think(tok, base, i, o):
    """Thought i: sampled on a fork of the problem's file, then scored on a fork of its own."""
    f = base.fork()
    t, ids, seed = tok.encode(f"Thought {i + 1}:"), [], o["seed"] * 1000 + i * 100
    while len(ids) < o["max_tokens"]:
        nxt = pred(f, t, output="sample", temperature=0.8, top_p=0.95, seed=seed + len(ids))
        if nxt in tok.eos_ids or "\n" in tok.decode([nxt]):
            break                                            # the thought ends; nxt is not kept
        ids.append(nxt)
        t = [nxt]
    generated = len(ids) + (len(ids) < o["max_tokens"])      # the closing token was decoded too
    pred(f, t, output="argmax")                              # feed the thought's last token
    with f.fork() as judge:                                  # the verification never touches f
        logits = pred(judge, tok.encode(reply_then_ask(tok, VERIFY)))
        lp = logits - logits.max()
        lp = lp - np.log(np.exp(lp).sum())                   # log-softmax
        score = float(lp[tok.encode("Yes")[0]])
    return {"thought": i + 1, "seed": seed, "text": tok.decode(ids).strip(), "score": round(score, 4),
            "generated": generated, "file": f}


def main(*args):
    problem, o = parse(args)
    tok = tokenizer()
    with kv.create() as base:
        pred(base, tok.encode_chat([{"role": "user", "content": problem}]), output="argmax")
        P = len(base)
        with ThreadPoolExecutor(o["thoughts"]) as pool:          # the threads share forward passes
            thoughts = list(pool.map(lambda i: think(tok, base, i, o), range(o["thoughts"])))
        best = sorted(thoughts, key=lambda th: -th["score"])[:o["keep"]]
        best.sort(key=lambda th: th["thought"])
        if o["exact"]:                                       # the kept thoughts as text, in order
            parts = []
            m = base.fork()
            t = tok.encode("".join(f"Thought {th['thought']}: {th['text']}\n" for th in best) + "\nFinal answer:")
            positions = None
        else:                                                # the thoughts' KV, cut out and merged
            parts = [th["file"].extract([[P, len(th["file"])]]) for th in best]
            m = kv.merge([base] + parts)
            start = P + max(len(p) for p in parts)           # after the longest thought
            t = tok.encode("\nFinal answer:")
            positions = list(range(start, start + len(t)))
        with m:
            merged = len(m) + (len(t) if not parts else 0)   # what the conclusion is decoded from
            lengths = [P] + ([len(p) for p in parts] if parts else [len(t)])
            ans = [pred(m, t, positions=positions, output="argmax")]
            while len(ans) < o["max_tokens"] and ans[-1] not in tok.eos_ids:
                ans.append(pred(m, [ans[-1]], output="argmax"))
        for th in thoughts:
            th.pop("file").close()
        for p in parts:
            p.close()
    send({"problem": problem,
          "thoughts": thoughts,
          "kept": [th["thought"] for th in best],
          "merged_length": merged, "merged_parts": lengths, "exact": bool(o["exact"]),
          "answer": tok.decode([a for a in ans if a not in tok.eos_ids]).strip(),
          "generated": sum(th["generated"] for th in thoughts) + len(ans)})
