"""What a forward pass costs, learned from the steps the kernel timed.

    StepCost.observe(tokens, calls, seconds)   a step that ran (`BatchScheduler.took`)
    StepCost.seconds(tokens, calls) -> float    the predicted time of a step, or None

The model is linear, ``seconds = base + per_token * tokens + per_call * calls``
(a step's fixed cost; the tokens its matrix products carry; each call's own
attention, sampling and bookkeeping), fitted by least squares over the steps
timed so far, the older ones weighted down by ``decay`` a step (the last ~50
steps count).  It is what makes "a step as wide as another user's work" mean
the same on every device: on a CPU a decode step of 16 sequences takes ~5x the
time of one, on a GPU about the same, and the fair share of a step
(share.py) is sized in predicted seconds, not tokens.

Each coefficient is kept >= 0.  What the steps seen cannot tell apart is not
guessed: while every step had the same tokens and calls as each other (one
user decoding alone), the fit is the conservative line through the origin
(a step twice as wide takes twice as long), which the next, narrower shared
steps then correct; while calls always equal tokens (decodes only), the two
per-item costs are one.
"""
from __future__ import annotations

from typing import Optional

MIN_SPREAD = 1.0            # variance of a feature (tokens^2) below which it tells nothing


class StepCost:
    def __init__(self, decay: float = 0.98):
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.decay = decay
        self.steps = 0
        self.learns = True
        # decayed sums: weight, tokens, calls, seconds and their products
        self._s = dict.fromkeys(("w", "t", "c", "y", "tt", "cc", "tc", "ty", "cy"), 0.0)
        self._coef: Optional[tuple[float, float, float]] = None

    @classmethod
    def fixed(cls, base: float, per_token: float, per_call: float = 0.0) -> "StepCost":
        """A model that does not learn (tests; a device whose costs are known)."""
        if min(base, per_token, per_call) < 0:
            raise ValueError("costs must be >= 0")
        m = cls()
        m.steps, m.learns = 1, False
        m._coef = (float(base), float(per_token), float(per_call))
        return m

    def observe(self, tokens: int, calls: int, seconds: float) -> None:
        """A step of ``tokens`` tokens in ``calls`` calls took ``seconds``."""
        if not self.learns or tokens < 1 or calls < 1 or not seconds >= 0.0:
            return
        s, d = self._s, self.decay
        for k in s:
            s[k] *= d
        s["w"] += 1.0
        s["t"] += tokens
        s["c"] += calls
        s["y"] += seconds
        s["tt"] += tokens * tokens
        s["cc"] += calls * calls
        s["tc"] += tokens * calls
        s["ty"] += tokens * seconds
        s["cy"] += calls * seconds
        self.steps += 1
        self._coef = None

    def seconds(self, tokens: int, calls: int) -> Optional[float]:
        """Predicted seconds of a step of ``tokens`` tokens in ``calls`` calls;
        None before any step was timed."""
        if not self.steps:
            return None
        base, per_token, per_call = self.coefficients()
        return base + per_token * tokens + per_call * calls

    def coefficients(self) -> tuple[float, float, float]:
        """(base, per_token, per_call) in seconds, each >= 0."""
        if self._coef is None:
            self._coef = self._fit()
        return self._coef

    # ------------------------------------------------------------------ helpers
    def _fit(self) -> tuple[float, float, float]:
        s = self._s
        w = s["w"]
        mt, mc, my = s["t"] / w, s["c"] / w, s["y"] / w
        vt, vc = s["tt"] / w - mt * mt, s["cc"] / w - mc * mc
        ctc, cty, ccy = s["tc"] / w - mt * mc, s["ty"] / w - mt * my, s["cy"] / w - mc * my
        if vt > MIN_SPREAD and vc > MIN_SPREAD:               # tokens and calls, if they moved apart
            det = vt * vc - ctc * ctc
            if det > 0.01 * vt * vc:
                a = (cty * vc - ccy * ctc) / det
                b = (ccy * vt - cty * ctc) / det
                base = my - a * mt - b * mc
                if a >= 0.0 and b >= 0.0 and base >= 0.0:
                    return base, a, b
        if vt > MIN_SPREAD:                                   # one cost per token (a call's folded in)
            a = cty / vt
            base = my - a * mt
            if a > 0.0 and base >= 0.0:
                return base, a, 0.0
        return 0.0, (s["ty"] / s["tt"]) if s["tt"] > 0 else 0.0, 0.0     # through the origin
