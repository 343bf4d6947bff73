"""Beam search over forked KV files; sends the best continuation and its score as JSON.

    symphony run userland/beam.py "The capital of France is" [--beams B] [--max-tokens N]
        [--length-penalty A]

Every live beam owns a KV file.  Each step, every beam's B most likely next
tokens (pred(..., output="topk", k=B): log-probs computed in the kernel) extend
it, and the B best extensions overall survive: one ending in EOS is finished,
any other gets a KV file (its parent's own for the parent's first survivor, a
copy-on-write fork for the others; parents left without survivors are closed)
and is fed its new token, one thread per beam so the kernel batches them.
Score = (sum of log-probs, EOS included) / (tokens generated)**A; A = 0
(default) is the plain sum, and then the search stops as soon as no live beam
can beat the best finished one.  Output: {"text", "tokens", "logprob", "score", "eos"}.
"""
import argparse
import heapq
from concurrent.futures import ThreadPoolExecutor

from symphony.lip import kv, pred, send, tokenize, tokenizer, vocab_size


def main(*args):
    p = argparse.ArgumentParser(prog="beam.py", description="Beam search decoding.")
    p.add_argument("prompt")
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--length-penalty", type=float, default=0.0)
    a = p.parse_args(args)
    if a.beams < 1 or a.max_tokens < 1:
        p.error("--beams and --max-tokens must be >= 1")
    eos, k = tokenizer().eos_ids, min(a.beams, vocab_size())
    score = lambda h: h[1] / len(h[0]) ** a.length_penalty          # h = (tokens, logprob, ...)

    def expand(beam):                       # feed the beam's last token; its top-k next tokens
        ids, lps = pred(beam[2], beam[0][-1:] or tokenize(a.prompt), output="topk", k=k)
        return ids.copy(), lps.copy()       # copies: the views die at this thread's next call

    live, finished = [([], 0.0, kv.create())], []                    # (tokens, logprob, KV file)
    with ThreadPoolExecutor(max_workers=min(k, 8)) as pool:
        for n in range(a.max_tokens):
            nexts = list(pool.map(expand, live))
            best = heapq.nlargest(a.beams, ((lp + float(d), i, int(t)) for i, ((_, lp, _), (ids, lps))
                                            in enumerate(zip(live, nexts)) for t, d in zip(ids, lps)))
            survivors, used = [], set()
            for lp, i, t in best:
                toks = live[i][0] + [t]
                if t in eos or n == a.max_tokens - 1:
                    finished.append((toks, lp, t in eos))
                else:                                                # fork before any child is fed
                    survivors.append((toks, lp, live[i][2].fork() if i in used else live[i][2]))
                    used.add(i)
            for i, beam in enumerate(live):
                if i not in used:
                    beam[2].close()
            live = survivors
            if not live or (a.length_penalty == 0 and finished
                            and max(h[1] for h in finished) >= max(h[1] for h in live)):
                break
    for beam in live:
        beam[2].close()
    toks, lp, ended = max(finished, key=score)
    text_ids = toks[:-1] if ended else toks
    send({"text": tokenizer().decode(text_ids, skip_special=True), "tokens": text_ids,
          "logprob": lp, "score": score((toks, lp)), "eos": ended})
