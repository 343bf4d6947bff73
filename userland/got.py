"""Graph of thoughts: branch, score, keep the best, merge their KV, conclude.

    symphony run userland/got.py "problem" [--thoughts 4] [--keep 2] [--max-tokens 48] [--seed 0]

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
   longest of them.
4. Conclude: "Final answer:" is appended to the merged file and decoded greedily.

Sends one JSON object: the thoughts with their scores, the kept ones, the
merged file's length and its parts' lengths, and the final answer.
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from symphony.lip import kv, pred, send, tokenizer

VERIFY = "Is this thought correct? Answer Yes or No."


def parse(args):
    opts = {"thoughts": 4, "keep": 2, "max_tokens": 48, "seed": 0}
    words, args = [], list(args)
    while args:
        a = args.pop(0)
        if a.startswith("--") and a[2:].replace("-", "_") in opts:
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
    pred(f, t, output="argmax")                              # feed the thought's last token
    with f.fork() as judge:                                  # the verification never touches f
        logits = pred(judge, tok.encode(reply_then_ask(tok, VERIFY)))
        lp = logits - logits.max()
        lp = lp - np.log(np.exp(lp).sum())                   # log-softmax
        score = float(lp[tok.encode("Yes")[0]])
    return {"thought": i + 1, "seed": seed, "text": tok.decode(ids).strip(), "score": round(score, 4),
            "file": f}


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
        parts = [th["file"].extract([[P, len(th["file"])]]) for th in best]   # the thoughts alone
        with kv.merge([base] + parts) as m:
            merged, lengths = len(m), [P] + [len(p) for p in parts]
            start = P + max(len(p) for p in parts)               # after the longest thought
            t = tok.encode("\nFinal answer:")
            ans = [pred(m, t, positions=list(range(start, start + len(t))), output="argmax")]
            while len(ans) < o["max_tokens"] and ans[-1] not in tok.eos_ids:
                ans.append(pred(m, [ans[-1]], output="argmax"))
        for th in thoughts:
            th.pop("file").close()
        for p in parts:
            p.close()
    send({"problem": problem,
          "thoughts": thoughts,
          "kept": [th["thought"] for th in best],
          "merged_length": merged, "merged_parts": lengths,
          "answer": tok.decode([a for a in ans if a not in tok.eos_ids]).strip()})
