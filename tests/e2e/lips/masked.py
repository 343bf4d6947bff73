"""pred with a token mask: only the allowed tokens can come out."""
from symphony.lip import kv, mask_words, pred, send, tokenize


def main():
    allowed = tokenize(" yes no maybe")
    with kv.create() as f:
        t = pred(f, tokenize("Answer:"), output="argmax", mask=allowed)
        logits = pred(f, [t], mask=mask_words(allowed))
        ok = sorted(int(i) for i in (logits > float("-inf")).nonzero()[0]) == sorted(set(allowed))
        s = pred(f, [t], output="sample", temperature=1.0, seed=1, mask=allowed)
    send({"argmax_in_mask": t in allowed, "logits_masked": ok, "sample_in_mask": s in allowed})
