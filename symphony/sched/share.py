"""Each user's share of one forward pass (the batch scheduler's policy, batch.py).

A step is *shared* when calls of two or more users are ready.  Then:

1. **How big the step may be** (`capacity`): the *even step* gives every
   user of the highest priority class present as many tokens as the
   lightest of them asks for (all of it for the lightest: its own work, and
   no more than that for the others); a shared step is kept within
   ``slowdown`` x the even step's predicted time (cost.py: tokens, calls and
   the attention over each call's context, so a chunk deep in a long prompt
   counts for the context it reads).  It takes the
   most tokens for which the predicted time of the shares that many tokens
   give stays within that, never fewer than one token per user with work,
   never more than the token budget.  One user alone (or before any step was
   timed) gets the whole budget, as before; users who ask alike get
   full-size steps.
2. **Who gets what** (`split`): weighted max-min (water-filling) of those
   tokens over the users' demands, with weight 4^priority (batch 1/4, normal
   1, interactive 4): a user who asks for less than an equal share gets all
   of it, the rest is split between the others in proportion to their
   weights.  Whole tokens left over by the rounding go one each to the users
   served least so far (tokens / weight), higher class first on ties.

So a user with one decoding sequence beside a user with sixteen rides in
every step, and the step is as narrow as keeps it within ``slowdown`` x the
step of one token each; the sixteen take turns in what is left.  A user with a long prompt
beside a decoder gets prefill chunks sized to the same promise.  Two heavy
users share full-size steps half and half.

Pure functions of plain values: `Demand` per user in, tokens per user out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .cost import StepCost, attention_pairs


def weight(priority: int) -> float:
    """A priority class's weight in a shared step: 4^priority."""
    return 4.0 ** priority


@dataclass
class Demand:
    """What one user could put in this step: the tokens of each of its ready
    calls' next chunk, in the order the user's calls would be taken."""

    user: str
    priority: int
    items: list = field(default_factory=list)   # tokens per call (1 for a decode)
    served: int = 0                             # tokens served so far (ties)
    contexts: list = field(default_factory=list)  # KV slots before each call's next chunk (0 if not given)

    @property
    def key(self) -> tuple:
        """A user's calls of one priority class share one demand."""
        return (self.priority, self.user)

    @property
    def tokens(self) -> int:
        return sum(self.items)

    def calls(self, tokens: int) -> int:
        """Calls that the user's first ``tokens`` tokens reach into."""
        return self.work(tokens)[0]

    def work(self, tokens: int) -> tuple[int, float]:
        """(calls, thousand query-key pairs of attention) of the user's first ``tokens`` tokens."""
        n, pairs = 0, 0.0
        for i, size in enumerate(self.items):
            if tokens <= 0:
                break
            n += 1
            pairs += attention_pairs(self.contexts[i] if i < len(self.contexts) else 0, min(size, tokens))
            tokens -= size
        return n, pairs


def split(demands: list[Demand], capacity: int) -> dict[tuple, int]:
    """Weighted max-min shares of ``capacity`` tokens: ``{demand.key: tokens}``,
    each at most the user's demand, summing to min(capacity, all demands)."""
    want = {d.key: d.tokens for d in demands}
    w = {d.key: weight(d.priority) for d in demands}
    share: dict[str, float] = {}
    left, pending = float(capacity), sorted(demands, key=lambda d: want[d.key] / w[d.key])
    while pending:
        wsum = sum(w[d.key] for d in pending)
        d = pending[0]
        fair = left * w[d.key] / wsum
        if want[d.key] <= fair:                        # asks for less than its share: all of it
            share[d.key] = want[d.key]
            left -= want[d.key]
            pending.pop(0)
            continue
        for d in pending:                               # the rest: in proportion to their weights
            share[d.key] = left * w[d.key] / wsum
        break
    out = {u: min(want[u], int(s + 1e-9)) for u, s in share.items()}
    spare = min(capacity, sum(want.values())) - sum(out.values())
    order = sorted(demands, key=lambda d: ((d.served + out[d.key]) / w[d.key], -d.priority, d.user))
    while spare > 0:
        moved = False
        for d in order:
            if spare and out[d.key] < want[d.key]:
                out[d.key] += 1
                spare -= 1
                moved = True
        if not moved:
            break
    return out


def capacity(demands: list[Demand], budget: int, cost: Optional[StepCost], slowdown: float) -> int:
    """The tokens a step of these users may take (see the module docstring)."""
    total = min(budget, sum(d.tokens for d in demands))
    if len(demands) < 2 or cost is None or not cost.steps:
        return total
    top = [d for d in demands if d.priority == max(x.priority for x in demands)]
    light = min(d.tokens for d in top)
    even = [min(d.tokens, light) for d in top]         # every top user as much as the lightest asks
    works = [d.work(n) for d, n in zip(top, even)]
    target = slowdown * cost.seconds(min(budget, sum(even)), sum(c for c, _ in works), sum(a for _, a in works))
    by_key = {d.key: d for d in demands}

    def fits(c: int) -> bool:
        shares = split(demands, c)
        works = [by_key[k].work(n) for k, n in shares.items()]
        return cost.seconds(sum(shares.values()), sum(c for c, _ in works), sum(a for _, a in works)) <= target

    lo = min(total, len(demands))
    if fits(total):
        return total
    if not fits(lo):
        return lo
    hi = total                                          # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
