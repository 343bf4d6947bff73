"""A green-list watermark (Kirchenbauer et al., 2023) and its detector.

    symphony run userland/watermark.py generate "Write a story." [--delta D] [--gamma G] [--key K]
                                                 [--max-tokens N] [--temperature T] [--seed S]
    symphony run userland/watermark.py detect "some text" ["more text" ...] [--gamma G] [--key K]
                                                 [--threshold Z]

generate: at every step the previous token and the secret key seed a split of
the vocabulary into a "green" fraction gamma and a red rest; delta is added to
the green tokens' logits before sampling, so the text leans green without
any one choice being forced.  The text is streamed.

detect: re-tokenizes the text and counts, over its distinct (previous token,
token) pairs, how many tokens are green for their predecessor.  Without the
watermark a token is green with probability gamma, so the count is compared
with that by a one-sided z-test; one JSON line per text:
{"z": z, "green": g, "total": n, "watermarked": z > threshold}.  Only the key
and gamma are needed, not the model's logits or the prompt.

The split is a keyed hash of (key, previous token, token), vectorised with
NumPy over the whole vocabulary (splitmix64 mixing in uint64 arithmetic; about
a millisecond a step), so generation and detection compute the same green
lists without storing any.  Sampling happens in the LIP, on the logits view
pred() returns, with `symphony.lip.sampling.Sampler` (--seed makes it
reproducible).  --delta 0 is plain sampling.
"""
import hashlib
import math
import sys

import numpy as np

from symphony.lip import StreamDecoder, kv, pred, send, tokenizer
from symphony.lip.sampling import Sampler

USAGE = ("usage: watermark.py generate PROMPT [--delta D] [--gamma G] [--key K] [--max-tokens N] "
         "[--temperature T] [--seed S]\n"
         "       watermark.py detect TEXT [TEXT ...] [--gamma G] [--key K] [--threshold Z]")

_M1 = np.uint64(0xBF58476D1CE4E5B9)         # splitmix64's constants
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31, _S32 = (np.uint64(s) for s in (30, 27, 31, 32))


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


class GreenList:
    """Token t is green after token p iff hash(key, p, t) < gamma * 2**32."""

    def __init__(self, key: str, gamma: float, vocab: int):
        if not 0 < gamma < 1:
            raise ValueError("gamma must be in (0, 1)")
        self.gamma, self.vocab = gamma, vocab
        self.key = np.frombuffer(hashlib.blake2b(key.encode(), digest_size=8).digest(), dtype=np.uint64)[0]
        self.cut = np.uint64(round(gamma * 2 ** 32))
        self.ids = np.arange(vocab, dtype=np.uint64) * _GOLD          # the tokens' half of the hash

    def _prev_seed(self, prev) -> np.ndarray:
        return _mix(np.asarray(prev, dtype=np.uint64) * _M2 ^ self.key)

    def mask(self, prev: int) -> np.ndarray:
        """Bool [vocab]: the green list after token ``prev``."""
        return (_mix(self.ids ^ self._prev_seed([prev])[0]) >> _S32) < self.cut

    def is_green(self, prev, tokens) -> np.ndarray:
        """Elementwise: is tokens[i] green after prev[i]?"""
        ids = np.asarray(tokens, dtype=np.uint64) * _GOLD
        return (_mix(ids ^ self._prev_seed(prev)) >> _S32) < self.cut

    def score(self, tokens, threshold: float = 4.0) -> dict:
        """The z-test over the distinct (previous, token) pairs of ``tokens`` (the
        first token has no known predecessor and is not scored)."""
        t = np.asarray(tokens, dtype=np.int64)
        pairs = np.sort(t[:-1] * self.vocab + t[1:])           # (prev, token) as one code
        pairs = pairs[np.r_[True, pairs[1:] != pairs[:-1]]] if pairs.size else pairs
        # (np.sort + diff, not np.unique: numpy 2's unique imports numpy.ma, which a LIP cannot)
        n = int(pairs.size)
        g = int(self.is_green(pairs // self.vocab, pairs % self.vocab).sum()) if n else 0
        z = (g - self.gamma * n) / math.sqrt(n * self.gamma * (1 - self.gamma)) if n else 0.0
        return {"z": round(z, 4), "green": g, "total": n, "watermarked": bool(z > threshold)}


def parse(args, conv, n_pos):
    opts = {k: d for k, (_, d) in conv.items()}
    pos = []
    it = iter(args)
    for a in it:
        if a.startswith("--"):
            if a not in conv:
                raise ValueError(f"unknown option {a}")
            v = next(it, None)
            if v is None:
                raise ValueError(f"{a} needs a value")
            opts[a] = conv[a][0](v)
        else:
            pos.append(a)
    if not (len(pos) == n_pos if n_pos else pos):
        raise ValueError("wrong number of arguments")
    return pos, {k[2:].replace("-", "_"): v for k, v in opts.items()}


def generate(prompt, delta=2.0, gamma=0.25, key="symphony", max_tokens=200, temperature=1.0, seed=None):
    tok = tokenizer()
    green = GreenList(key, gamma, tok.vocab_size)
    sampler = Sampler(temperature=temperature, seed=seed)
    out = StreamDecoder(tok)
    with kv.create() as f:
        t = tok.encode_chat([{"role": "user", "content": prompt}])
        prev = t[-1]
        for _ in range(max_tokens):
            logits = pred(f, t)[: tok.vocab_size].astype(np.float64)   # the view, copied once
            if delta:
                logits[green.mask(prev)] += delta
            prev = sampler.sample(logits)
            if prev in tok.eos_ids:
                break
            piece = out.push(prev)
            if piece:
                send(piece)
            t = [prev]
    send(out.flush() + "\n")


def main(cmd=None, *args):
    try:
        if cmd == "generate":
            (prompt,), o = parse(args, {"--delta": (float, 2.0), "--gamma": (float, 0.25),
                                        "--key": (str, "symphony"), "--max-tokens": (int, 200),
                                        "--temperature": (float, 1.0), "--seed": (int, None)}, 1)
            if o["max_tokens"] < 1 or o["temperature"] < 0 or not 0 < o["gamma"] < 1:
                raise ValueError("--max-tokens >= 1, --temperature >= 0, --gamma in (0, 1)")
            generate(prompt, **o)
        elif cmd == "detect":
            texts, o = parse(args, {"--gamma": (float, 0.25), "--key": (str, "symphony"),
                                    "--threshold": (float, 4.0)}, 0)
            tok = tokenizer()
            green = GreenList(o["key"], o["gamma"], tok.vocab_size)
            for text in texts:
                send(green.score(tok.encode(text, add_bos=False), o["threshold"]))
        else:
            raise ValueError("the command is generate or detect")
    except ValueError as e:
        print(f"watermark: {e}\n{USAGE}", file=sys.stderr)
        return 2
    return 0
