"""pred with logit_bias: each output (logits, topk, argmax, sample) against the plain
logits of the same file plus the bias, computed here; then bad biases, each refused."""
import numpy as np

from symphony.lip import InvalidArgument, kv, pred, send, tokenize, vocab_size


def main():
    prompt = tokenize("The capital of France is")
    out = {}
    with kv.create() as f:
        pred(f, prompt[:-1], output="argmax")
        with f.fork() as g:
            plain = np.array(pred(g, prompt[-1:]))                          # [vocab], no bias
        top = int(np.argmax(plain))
        runner_up = int(np.argsort(-plain)[1])
        bias = {top: -100.0, runner_up: 5.5, 7: 100.0}
        want = plain.copy()
        for t, v in bias.items():
            want[t] += v
        with f.fork() as g:
            got = np.array(pred(g, prompt[-1:], logit_bias=bias))
            out["logits_max_diff"] = float(np.abs(got - want).max())
        with f.fork() as g:
            out["argmax"] = [pred(g, prompt[-1:], output="argmax", logit_bias=list(bias.items())),
                             int(np.argmax(want))]
        with f.fork() as g:                                             # the bias comes before the mask
            out["masked_argmax"] = [pred(g, prompt[-1:], output="argmax", logit_bias={runner_up: 100.0},
                                         mask=[top, 5]), int(5 if plain[5] > plain[top] else top)]
        with f.fork() as g:
            ids, lps = pred(g, prompt[-1:], output="topk", k=3, logit_bias=bias)
            lsm = want - want.max() - np.log(np.exp(want - want.max()).sum())
            order = np.argsort(-want)[:3]
            out["topk"] = [ids.tolist(), order.tolist(), float(np.abs(lps - lsm[order]).max())]
        with f.fork() as g:                                             # a bias of +100 forces a token
            out["sample"] = pred(g, prompt[-1:], output="sample", temperature=1.0, seed=3,
                                 logit_bias={11: 100.0})
        with f.fork() as g:
            out["length_after"] = [len(g), pred(g, prompt[-1:], output="argmax") is not None, len(g)]
        bad = {"id_out_of_vocab": {vocab_size(): 1.0}, "negative_id": {-1: 1.0}, "too_big": {5: 100.5},
               "nan": {5: float("nan")}, "inf": {5: float("inf")}, "repeated": [(5, 1.0), (5, 2.0)],
               "too_many": {i: 1.0 for i in range(1025)}, "not_pairs": [5, 6], "string_ids": {"5": 1.0}}
        refused = {}
        for name, b in bad.items():
            n = len(f)
            try:
                pred(f, prompt[-1:], output="argmax", logit_bias=b)
                refused[name] = "accepted"
            except InvalidArgument as e:
                refused[name] = "EINVAL" if len(f) == n else f"EINVAL but the file grew: {e}"
        out["refused"] = refused
    send(out)
