"""What a forward pass costs, learned from the steps the kernel timed.

    StepCost.observe(tokens, calls, seconds, pairs, reads)   a step that ran (`BatchScheduler.took`)
    StepCost.seconds(tokens, calls, pairs, reads) -> float   the predicted time of a step, or None

The model is linear, ``seconds = base + per_token * tokens + per_call * calls
+ per_kpair * (pairs + read_pairs * reads)``: a step's fixed cost; the tokens
its matrix products carry; each call's own sampling and bookkeeping; and its
attention, in two parts: ``pairs``, the step's query-key pairs in thousands
(`attention_pairs`: the arithmetic, n x context for n tokens), and ``reads``,
the keys its calls read in thousands (`attention_reads`: each call reads its
context's K/V rows once, whatever its n, so that one token deep in a long
prompt costs a whole pass over that context, which its pairs alone would price
at nearly nothing).  What reading a key costs in pairs, ``read_pairs``, is
the device's and its attention kernel's: the kernel measures it at start-up
(`symphony.engine.attn_cost`; 0 until then), for in a stream of steps the
keys read move with the step's fixed cost too closely to be told apart.  The
rest is fitted by least squares over the steps timed so far, the older ones
weighted down by ``decay`` a step (the last ~50 steps count).  It is what
makes "a step as wide as another user's work" mean the same on every device:
on a CPU a decode step of 16 sequences takes ~5x the time of one, on a GPU
about the same, and the fair share of a step (share.py) is sized in
predicted seconds, not tokens.

Each coefficient is kept >= 0.  What the steps seen cannot tell apart is not
guessed: a feature that did not vary is left out; while every step had the same tokens and calls as each
other (one user decoding alone), the fit is the conservative line through the
origin (a step twice as wide takes twice as long), which the next, narrower
shared steps then correct; while calls always equal tokens (decodes only), the
two per-item costs are one.
"""
from __future__ import annotations

from typing import Optional

MIN_SPREAD = 1.0            # variance of a feature (tokens^2) below which it tells nothing
FEATURES = ("t", "c", "a")  # tokens, calls, attention (thousand pairs, reads counted in pairs)
# the subsets tried, in order, until one fits with every coefficient >= 0
SUBSETS = (("t", "c", "a"), ("t", "a"), ("t", "c"), ("t",))


def attention_pairs(context: int, n: int) -> float:
    """Query-key pairs, in thousands, of ``n`` tokens fed after ``context`` cached ones
    (causal: token i sees the context and the i tokens before it and itself)."""
    return n * (context + (n + 1) / 2) / 1000.0


def attention_reads(context: int, n: int) -> float:
    """Keys, in thousands, whose K/V rows one call of ``n`` tokens after ``context`` cached ones
    reads (each once: its tokens' queries share the pass over them)."""
    return (context + n) / 1000.0 if n > 0 else 0.0


class StepCost:
    def __init__(self, decay: float = 0.98, read_pairs: float = 0.0):
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.decay = decay
        self.read_pairs = self._checked_read_pairs(read_pairs)
        self.steps = 0
        self.learns = True
        # decayed sums: weight, each feature, seconds, and their products
        keys = ["w", "y"] + list(FEATURES) + [f + "y" for f in FEATURES] + \
            [a + b for i, a in enumerate(FEATURES) for b in FEATURES[i:]]
        self._s = dict.fromkeys(keys, 0.0)
        self._coef: Optional[tuple[float, float, float, float, float]] = None

    @classmethod
    def fixed(cls, base: float, per_token: float, per_call: float = 0.0, per_kpair: float = 0.0,
              per_kread: float = 0.0) -> "StepCost":
        """A model that does not learn (tests; a device whose costs are known)."""
        if min(base, per_token, per_call, per_kpair, per_kread) < 0:
            raise ValueError("costs must be >= 0")
        m = cls()
        m.steps, m.learns = 1, False
        m._coef = (float(base), float(per_token), float(per_call), float(per_kpair), float(per_kread))
        return m

    def observe(self, tokens: int, calls: int, seconds: float, pairs: float = 0.0, reads: float = 0.0) -> None:
        """A step of ``tokens`` tokens in ``calls`` calls, ``pairs`` thousand query-key
        pairs of attention over ``reads`` thousand keys read, took ``seconds``."""
        if not self.learns or tokens < 1 or calls < 1 or not seconds >= 0.0 or not pairs >= 0.0 \
                or not reads >= 0.0:
            return
        s, d = self._s, self.decay
        for k in s:
            s[k] *= d
        x = {"t": float(tokens), "c": float(calls), "a": float(pairs) + self.read_pairs * float(reads)}
        s["w"] += 1.0
        s["y"] += seconds
        for i, a in enumerate(FEATURES):
            s[a] += x[a]
            s[a + "y"] += x[a] * seconds
            for b in FEATURES[i:]:
                s[a + b] += x[a] * x[b]
        self.steps += 1
        self._coef = None

    def seconds(self, tokens: int, calls: int, pairs: float = 0.0, reads: float = 0.0) -> Optional[float]:
        """Predicted seconds of a step of ``tokens`` tokens in ``calls`` calls with ``pairs``
        thousand query-key pairs over ``reads`` thousand keys read; None before any step was timed."""
        if not self.steps:
            return None
        base, per_token, per_call, per_kpair, per_kread = self.coefficients()
        return base + per_token * tokens + per_call * calls + per_kpair * pairs + per_kread * reads

    def set_read_pairs(self, read_pairs: float) -> None:
        """What reading a key costs, in query-key pairs (measured on the device); the steps
        fitted with another value are forgotten."""
        read_pairs = self._checked_read_pairs(read_pairs)
        if read_pairs != self.read_pairs and self.learns:
            self.read_pairs, self.steps, self._coef = read_pairs, 0, None
            self._s = dict.fromkeys(self._s, 0.0)

    @staticmethod
    def _checked_read_pairs(x: float) -> float:
        if not isinstance(x, (int, float)) or not 0.0 <= x < float("inf"):
            raise ValueError(f"read_pairs must be a finite number >= 0, got {x!r}")
        return float(x)

    def coefficients(self) -> tuple[float, float, float, float, float]:
        """(base, per_token, per_call, per_kpair, per_kread) in seconds, each >= 0."""
        if self._coef is None:
            self._coef = self._fit()
        return self._coef

    # ------------------------------------------------------------------ helpers
    def _fit(self) -> tuple[float, float, float, float, float]:
        s = self._s
        w = s["w"]
        mean = {f: s[f] / w for f in FEATURES}
        my = s["y"] / w

        def cov(a: str, b: str) -> float:
            key = a + b if FEATURES.index(a) <= FEATURES.index(b) else b + a
            return s[key] / w - mean[a] * mean[b]

        moved = {f for f in FEATURES if cov(f, f) > MIN_SPREAD}
        for subset in SUBSETS:
            if not set(subset) <= moved:
                continue
            coef = _solve([[cov(a, b) for b in subset] for a in subset],
                          [s[a + "y"] / w - mean[a] * my for a in subset])
            if coef is None or min(coef) < 0.0 or (len(subset) == 1 and coef[0] <= 0.0):
                continue
            base = my - sum(c * mean[f] for c, f in zip(coef, subset))
            if base >= 0.0:
                got = dict(zip(subset, coef))
                a = got.get("a", 0.0)
                return base, got.get("t", 0.0), got.get("c", 0.0), a, a * self.read_pairs
        return 0.0, (s["ty"] / s["tt"]) if s["tt"] > 0 else 0.0, 0.0, 0.0, 0.0    # through the origin


def _solve(m: list[list[float]], v: list[float]) -> Optional[list[float]]:
    """x with m x = v for a small symmetric covariance matrix ``m`` (Gaussian elimination),
    or None when the features are too nearly dependent to be told apart (the determinant
    under 1 % of the product of their variances)."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    scale = 1.0
    for i in range(n):
        scale *= m[i][i]
    det = 1.0
    for i in range(n):
        p = max(range(i, n), key=lambda r: abs(a[r][i]))
        if a[p][i] == 0.0:
            return None
        if p != i:
            a[i], a[p] = a[p], a[i]
            det = -det
        det *= a[i][i]
        for r in range(i + 1, n):
            f = a[r][i] / a[i][i]
            for k in range(i, n + 1):
                a[r][k] -= f * a[i][k]
    if not det > 0.01 * scale:
        return None
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (a[i][n] - sum(a[i][k] * x[k] for k in range(i + 1, n))) / a[i][i]
    return x
