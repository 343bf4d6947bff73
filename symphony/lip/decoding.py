"""One sequence's decode step: the next token(s) of a KV file, chosen the cheapest way.

    d = Decoder(f, temperature=0.7, top_p=0.9, seed=1)
    feed = prompt
    while ...:
        out = d.step(feed, budget)        # [(token, Logprob or None)]: forced tokens, then one chosen
        feed = [out[-1][0]]

Where the token is chosen:
  * greedy, nothing else asked: ``pred(output="argmax")``, only a token id crosses;
  * sampling (temperature > 0, top-k, top-p, min-p): ``pred(output="sample")`` in the kernel,
    with one seed per step derived from ``seed`` (the same seed gives the same tokens);
  * log-probabilities or presence/frequency penalties asked: the logits come
    back and the LIP chooses (argmax, or `Sampler` seeded with ``seed``).  Log-
    probabilities are of the model's raw distribution (log-softmax of the logits,
    before penalties, grammar mask and temperature).

A grammar (an llguidance ``LLMatcher``) constrains the choice: its bitmask is
applied in the kernel (or in the LIP with the logits), and the tokens it forces
(``compute_ff_tokens``) are appended without being chosen.  Penalties follow
OpenAI: ``logit -= presence * (count > 0) + frequency * count`` over the tokens
this decoder has produced (forced ones included).  ``logit_bias`` ({token id:
bias}) is added to the logits before the mask, in the kernel (``pred(logit_bias=)``)
or here with the logits.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np

from .runtime import KVFile, pred
from .sampling import Sampler, log_softmax

__all__ = ["Decoder", "Logprob", "GrammarError", "step_seed"]

_STEP_SEED = 0x9E3779B97F4A7C15          # mixes (seed, step) into one seed per kernel draw
MAX_ROWS = 8                              # all_logits rows one pred may return


class Logprob(NamedTuple):
    """A token's log-probability and the ``top`` most probable alternatives (ids, logprobs)."""
    logprob: float
    top_ids: list
    top_logprobs: list


class GrammarError(RuntimeError):
    """The grammar refused a token the mask allowed (an llguidance inconsistency)."""


def step_seed(seed: Optional[int], step: int) -> Optional[int]:
    """The kernel sampling seed of draw ``step`` (the same seed at every step
    would draw the same uniform number every time)."""
    return None if seed is None else (seed * _STEP_SEED + step) & 0xFFFFFFFFFFFF


class Decoder:
    """Chooses the next tokens of the sequence held by KV file ``f``.

    ``top_logprobs``: None (no log-probabilities) or how many alternatives to
    report with each token (0..20); ``eos_ids``: tokens that end the sequence
    (the matcher must accept them); ``pred``: the system call to use (a
    wrapper may retry it)."""

    def __init__(self, f: KVFile, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 min_p: float = 0.0, seed: Optional[int] = None, presence: float = 0.0, frequency: float = 0.0,
                 top_logprobs: Optional[int] = None, matcher=None, eos_ids: Sequence[int] = (),
                 vocab: int = 0, pred=pred, logit_bias: Optional[dict] = None):
        self.pred = pred                  # the pred system call (a caller may wrap it)
        self.f, self.temperature, self.top_p, self.seed = f, float(temperature), float(top_p), seed
        self.top_k, self.min_p = int(top_k), float(min_p)
        self.bias = sorted((logit_bias or {}).items()) or None       # [(token id, bias)]
        self.presence, self.frequency, self.top = float(presence), float(frequency), top_logprobs
        self.matcher, self.eos_ids, self.vocab = matcher, tuple(eos_ids), vocab
        self.penalize = bool(self.presence or self.frequency)
        self.in_lip = self.penalize or top_logprobs is not None
        self.counts = np.zeros(vocab, dtype=np.int32) if self.penalize else None
        self.sampler = Sampler(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                               min_p=self.min_p, seed=seed) \
            if self.in_lip and self.temperature > 0 else None
        self.steps = 0
        self.words = (vocab + 31) // 32

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing more may follow."""
        return self.matcher is not None and self.matcher.is_stopped()

    def step(self, feed: Sequence[int], budget: int) -> list[tuple[int, Optional[Logprob]]]:
        """Append ``feed`` (at least one token) to the file and return up to
        ``budget`` next tokens: the ones the grammar forces, then one chosen (an
        end-of-sequence token is returned like any other).  The last token
        returned is not in the file yet (feed it next); when forced tokens reach
        ``budget`` or complete the grammar no token is chosen, and ``len(f)``
        says how much of the sequence the file holds."""
        feed = list(feed)
        ff = self._forced(budget)
        if len(ff) >= budget or self.done:                     # nothing to choose
            if self.top is None or not ff:
                return [(t, None) for t in ff]
            rows = self._rows(feed + ff[:-1], len(ff))
            return [(t, self._logprob(rows[j], t)) for j, t in enumerate(ff)]
        mask = self._mask()
        if not self.in_lip:
            if self.temperature > 0:
                x = self.pred(self.f, feed + ff, output="sample", temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, seed=step_seed(self.seed, self.steps), mask=mask,
                              logit_bias=self.bias)
            else:
                x = self.pred(self.f, feed + ff, output="argmax", mask=mask, logit_bias=self.bias)
            out = [(t, None) for t in ff] + [(x, None)]
        else:
            rows = self._rows(feed + ff, len(ff) + 1 if self.top is not None else 1)
            x = self._choose(rows[-1], mask)
            out = [(t, None) for t in ff] + [(x, None)]
            if self.top is not None:
                out = [(t, self._logprob(rows[j], t)) for j, (t, _) in enumerate(out)]
        self.steps += 1
        self._advance(x)
        if self.counts is not None:
            self.counts[x] += 1
        return out

    # ------------------------------------------------------------ helpers
    def _forced(self, budget: int) -> list[int]:
        m = self.matcher
        if m is None:
            return []
        ff = list(m.compute_ff_tokens())[:budget]
        if ff and not m.consume_tokens(ff):
            raise GrammarError(f"llguidance: {m.get_error()}")
        if self.counts is not None:
            for t in ff:
                self.counts[t] += 1
        return ff

    def _mask(self) -> Optional[np.ndarray]:
        if self.matcher is None:
            return None
        # little-endian uint32 words, bit i = token i (llguidance's trie may add a word)
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)[:self.words]
        if self.matcher.is_error():
            raise GrammarError(f"llguidance: {self.matcher.get_error()}")
        return words

    def _advance(self, x: int) -> None:
        m = self.matcher
        if m is not None and not m.consume_token(x):
            raise GrammarError(f"llguidance refused token {x}: {m.get_error()}")

    def _rows(self, seq: list, n: int) -> list:
        """Feed ``seq``; the logits rows (copies) of its last ``n`` tokens."""
        if n == 1:
            return [np.array(self.pred(self.f, seq))]
        if len(seq) > n:
            self.pred(self.f, seq[:-n], output="argmax")                  # the prompt: no logits needed
        rows = []
        for i in range(len(seq) - n, len(seq), MAX_ROWS):
            rows += list(np.array(self.pred(self.f, seq[i:min(i + MAX_ROWS, len(seq))], all_logits=True)))
        return rows

    def _choose(self, row: np.ndarray, mask) -> int:
        x = np.array(row, dtype=np.float64)
        for t, b in self.bias or ():
            x[t] += b
        if self.counts is not None:
            x -= self.presence * (self.counts > 0) + self.frequency * self.counts
        if mask is not None:
            allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:x.size].astype(bool)
            x[~allowed] = -np.inf
        if self.sampler is None:
            return int(np.argmax(x))
        return self.sampler.sample(x)

    def _logprob(self, row: np.ndarray, t: int) -> Logprob:
        lp = log_softmax(row)
        if self.top:
            top = np.argpartition(-lp, self.top - 1)[:self.top]
            top = top[np.argsort(-lp[top], kind="stable")]
        else:
            top = np.zeros(0, dtype=np.int64)
        return Logprob(float(lp[t]), top.tolist(), lp[top].tolist())
