"""Sampling for LIPs: choose the next token from the logits a `pred` returned.

    from symphony.lip import kv, pred, tokenize
    from symphony.lip.sampling import Sampler

    s = Sampler(temperature=0.8, top_p=0.95, repetition_penalty=1.1, seed=7)
    with kv.create() as f:
        history = tokenize("Once upon a time")
        t = s.sample(pred(f, history), history)          # logits: a zero-copy NumPy view

The pipeline of `Sampler.sample`, in order (the order Hugging Face and
llama.cpp use):

1. **repetition penalty** (CTRL, Keskar et al. 2019): the logit of every token
   in ``history`` is divided by ``repetition_penalty`` when positive and
   multiplied by it when negative (> 1 discourages repeats, < 1 encourages);
2. **temperature**: logits / temperature; ``temperature=0`` is greedy (argmax
   after the penalty, no randomness, the filters are moot);
3. **top-k**: keep the ``top_k`` highest logits (0 = off; tokens tied with the
   k-th are kept too);
4. **top-p** (nucleus, Holtzman et al. 2019): keep the smallest set of most
   probable tokens whose probability sums to at least ``top_p`` (1 = off);
5. **min-p**: keep tokens whose probability is at least ``min_p`` times the
   most probable token's (0 = off);
6. draw from the renormalised distribution with a ``numpy.random.Generator``
   seeded with ``seed``: the same seed, logits and history give the same
   tokens (``seed=None``: fresh entropy).

Logits of ``-inf`` (a token mask) are never chosen.

**Sampling in the kernel or in the LIP?**  ``pred(f, t, output="sample",
temperature=..., top_p=..., top_k=..., seed=...)`` samples inside the kernel
and returns only the token id: no logits cross into the LIP, which is the
cheapest path (no copy of a vocabulary-sized row, no NumPy work per token) and
the right one for plain temperature/top-k/top-p decoding (``output="argmax"``
for greedy).  Sample in the LIP with this module when you need what the
kernel does not offer (repetition penalty, min-p, your own logit processors,
bias or constraints computed from the text so far, several samples from one
distribution, the probabilities themselves), or want this module's exact,
seed-reproducible sequence.  The two are not bit-identical: the kernel uses
its own random generator and nucleus boundary rule.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import numpy as np

__all__ = ["Sampler", "log_softmax", "softmax"]


def log_softmax(logits) -> np.ndarray:
    """log-probabilities over the last axis (float64 for accuracy; ``-inf`` stays ``-inf``)."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    if not np.all(np.isfinite(m)):
        raise ValueError("logits must hold at least one finite value per row and no NaN or +inf")
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def softmax(logits) -> np.ndarray:
    """probabilities over the last axis (float64)."""
    return np.exp(log_softmax(logits))


def _number(name: str, v, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or math.isnan(v):
        raise ValueError(f"{name} must be a number, got {v!r}")
    if v < lo or (lo_open and v == lo) or v > hi:
        rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise ValueError(f"{name} must be in {rng}, got {v!r}")
    return float(v)


class Sampler:
    """Temperature / top-k / top-p / min-p sampling with a CTRL repetition penalty."""

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, seed: Optional[int] = None):
        self.temperature = _number("temperature", temperature, 0.0, math.inf)
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
        self.top_k = int(top_k)
        self.top_p = _number("top_p", top_p, 0.0, 1.0, lo_open=True)
        self.min_p = _number("min_p", min_p, 0.0, 1.0)
        self.repetition_penalty = _number("repetition_penalty", repetition_penalty, 0.0, math.inf, lo_open=True)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ValueError(f"seed must be None or an int >= 0, got {seed!r}")
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def __repr__(self):
        return (f"Sampler(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, "
                f"min_p={self.min_p}, repetition_penalty={self.repetition_penalty}, seed={self.seed})")

    @property
    def greedy(self) -> bool:
        """True when sampling is plain argmax (so ``pred(..., output="argmax")`` can do it)."""
        return self.temperature == 0 and self.repetition_penalty == 1.0

    def penalize(self, logits, history: Iterable[int] = ()) -> np.ndarray:
        """Step 1: a float64 copy of ``logits`` with the repetition penalty applied."""
        x = np.array(logits, dtype=np.float64)              # a copy: never write the pred view
        if x.ndim != 1 or x.size == 0:
            raise ValueError(f"logits must be a 1-D array [vocab], got shape {x.shape}")
        if np.isnan(x).any() or np.isposinf(x).any() or not np.isfinite(x).any():
            raise ValueError("logits must be finite or -inf (masked), with at least one finite value")
        if self.repetition_penalty != 1.0:
            h = np.asarray(list(history), dtype=np.int64)
            if h.size and (h.min() < 0 or h.max() >= x.size):
                raise ValueError(f"history holds token ids outside [0, {x.size})")
            h = np.flatnonzero(np.bincount(h, minlength=x.size))    # each token once
            v = x[h]
            x[h] = np.where(v > 0, v / self.repetition_penalty, v * self.repetition_penalty)
        return x

    def probs(self, logits, history: Iterable[int] = ()) -> np.ndarray:
        """Steps 1-5: the distribution `sample` draws from (float64, zeros for filtered tokens)."""
        x = self.penalize(logits, history)
        if self.temperature == 0:
            p = np.zeros_like(x)
            p[int(np.argmax(x))] = 1.0
            return p
        x /= self.temperature
        if 0 < self.top_k < x.size:
            kth = np.partition(x, x.size - self.top_k)[x.size - self.top_k]
            x[x < kth] = -np.inf
        p = softmax(x)
        if self.top_p < 1.0:
            nz = np.flatnonzero(p)                             # sort only the survivors
            order = nz[np.argsort(-p[nz], kind="stable")]
            before = np.cumsum(p[order]) - p[order]          # mass of the more probable tokens
            p[order[before >= self.top_p]] = 0.0             # the first token is always kept
        if self.min_p > 0.0:
            p[p < self.min_p * p.max()] = 0.0
        return p / p.sum()

    def sample(self, logits, history: Iterable[int] = ()) -> int:
        """The next token id.  ``history``: the tokens so far (for the repetition penalty)."""
        if self.temperature == 0:
            return int(np.argmax(self.penalize(logits, history)))
        c = np.cumsum(self.probs(logits, history))
        return int(min(np.searchsorted(c, self.rng.random() * c[-1], side="right"), c.size - 1))
