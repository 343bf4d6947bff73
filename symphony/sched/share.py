"""Each user's share of one forward pass (the batch scheduler's policy, batch.py).

A step is *shared* when calls of two or more users are ready.  Then:

0. **Who sits out** (`deferred`): a user whose least part - one token of its
   first call - would add to the step of the lightest top-priority user more
   than ``slowdown - 1`` times that step and more than ``slowdown`` times
   what that user's own part adds (a token deep in a long prompt reads the
   whole context before it: one token 2,800 deep costs more than a decoder's
   whole step on a CPU) cannot share a step within the promise at all.  It
   sits out, but for turns: it earns credit for each step it misses and
   comes in with as many tokens as its credit pays for (`allowance`; the
   batch scheduler keeps the credit, batch.py `_shares`), so that on
   average the others' steps stay within ``slowdown`` x theirs plus its
   turns, and it is never starved.
1. **How big the step may be** (`capacity`), among the others: the *even
   step* is the lightest top-priority user's work once for every user of
   that class present (as many tokens as it asks for, each priced as its
   own: a user whose tokens cost more - deep in a long prompt - does not
   widen the step the others are measured against); a shared step is kept
   within ``slowdown`` x the even step's predicted time (cost.py: tokens,
   calls and the attention over each call's context, so a chunk deep in a
   long prompt counts for the context it reads).  It takes the most tokens
   for which the predicted time of the shares that many tokens give stays
   within that, never fewer than one token per user with work, never more
   than the token budget.  One user alone (or before any step was timed)
   gets the whole budget, as before; users who ask alike get full-size
   steps.
2. **Who gets what** (`split`): weighted max-min (water-filling) of those
   tokens over the users' demands, with weight 4^priority (batch 1/4, normal
   1, interactive 4): a user who asks for less than an equal share gets all
   of it, the rest is split between the others in proportion to their
   weights.  Whole tokens left over by the rounding go one each to the users
   served least so far (tokens / weight), higher class first on ties.

So a user with one decoding sequence beside a user with sixteen rides in
every step, and the step is as narrow as keeps it within ``slowdown`` x the
step of one token each; the sixteen take turns in what is left.  A user with a long prompt
beside a decoder gets prefill chunks sized to the same promise, and deep in
that prompt, turns.  Two heavy users share full-size steps half and half.

Pure functions of plain values: `Demand` per user in, tokens per user out.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

from .cost import StepCost, attention_pairs, attention_reads


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
        return self._sums[0][-1]

    def calls(self, tokens: int) -> int:
        """Calls that the user's first ``tokens`` tokens reach into."""
        return self.work(tokens)[0]

    def work(self, tokens: int) -> tuple[int, float, float]:
        """(calls, thousand query-key pairs, thousand keys read) of the attention of the user's
        first ``tokens`` tokens: whole calls from running sums, the last one cut (O(log calls):
        the scheduler asks this many times a step)."""
        if tokens <= 0:
            return 0, 0.0, 0.0
        toks, pairs, reads = self._sums
        n = len(self.items)
        i = bisect_left(toks, tokens, 1)        # calls 0..i-2 whole, call i-1 reaches ``tokens``
        if i > n:                                # more than all: every call whole
            return n, pairs[n], reads[n]
        ctx = self.contexts[i - 1] if i - 1 < len(self.contexts) else 0
        part = tokens - toks[i - 1]
        return i, pairs[i - 1] + attention_pairs(ctx, part), reads[i - 1] + attention_reads(ctx, part)

    @cached_property
    def _sums(self) -> tuple[list, list, list]:
        """Running sums over the calls (tokens, pairs, reads; element i: the first i calls),
        made once: a Demand is built per step and its items are not changed after."""
        toks, pairs, reads = [0], [0.0], [0.0]
        for i, size in enumerate(self.items):
            ctx = self.contexts[i] if i < len(self.contexts) else 0
            toks.append(toks[-1] + size)
            pairs.append(pairs[-1] + attention_pairs(ctx, size))
            reads.append(reads[-1] + attention_reads(ctx, size))
        return toks, pairs, reads


def step_seconds(cost: StepCost, parts: list[tuple["Demand", int]]) -> float:
    """Predicted seconds of a step of these (demand, tokens) parts."""
    tokens, calls, pairs, reads = 0, 0, 0.0, 0.0
    for d, n in parts:
        if n > 0:
            c, a, r = d.work(n)
            tokens, calls, pairs, reads = tokens + n, calls + c, pairs + a, reads + r
    return cost.seconds(tokens, calls, pairs, reads)


def split(demands: list[Demand], capacity: int) -> dict[tuple, int]:
    """Weighted max-min shares of ``capacity`` tokens: ``{demand.key: tokens}``,
    each at most the user's demand, summing to min(capacity, all demands)."""
    want = {d.key: d.tokens for d in demands}
    if sum(want.values()) <= capacity:                 # room for all: water-filling gives each its all
        return want
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
    light = min(top, key=lambda d: (d.tokens, step_seconds(cost, [(d, d.tokens)])))
    target = slowdown * step_seconds(cost, [(light, light.tokens)] * len(top))  # the even step
    by_key = {d.key: d for d in demands}

    def fits(c: int) -> bool:
        return step_seconds(cost, [(by_key[k], n) for k, n in split(demands, c).items()]) <= target

    return largest_within(min(total, len(demands)), total, fits)


def largest_within(lo: int, hi: int, ok) -> int:
    """The largest n in [lo, hi] with ``ok(n)``, by halves (``ok`` holds up to some n and not
    after); ``lo`` when it holds nowhere."""
    if ok(hi):
        return hi
    if not ok(lo):
        return lo
    while hi - lo > 1:                                  # ok(lo), not ok(hi)
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def deferred(demands: list[Demand], cost: Optional[StepCost], slowdown: float) -> set:
    """The users who sit out a shared step but for their turns (see the module docstring):
    those whose least part - one token of their first call - would add to the step of the
    lightest top-priority user both more than ``slowdown - 1`` times that step and more than
    ``slowdown`` times what that user's own part adds (a token deep in a long prompt reads the
    whole context before it; an ordinary token costs what his do).  That user never sits out;
    nor does anyone when one user has work or nothing was timed yet."""
    if len(demands) < 2 or cost is None or not cost.steps:
        return set()
    top = max(d.priority for d in demands)
    alone = {d.key: step_seconds(cost, [(d, d.items[0])]) for d in demands if d.priority == top}
    light = next(d for d in demands if d.key == min(alone, key=lambda k: (alone[k], k)))
    t = alone[light.key]
    own = t - cost.seconds(0, 0)
    bound = max((slowdown - 1.0) * t, slowdown * own)
    return {d.key for d in demands if d is not light
            and step_seconds(cost, [(light, light.items[0]), (d, 1)]) - t > bound}


def allowance(d: Demand, credit: float, least: int, room: int, cost: StepCost, step: list) -> tuple[int, float]:
    """(tokens, seconds) a sitting-out user ``d`` puts in this step: the most tokens, within its
    demand and ``room``, whose added cost to the ``step`` of the others [(demand, tokens)] its
    ``credit`` (seconds) covers, and that cost; (0, 0) while it does not cover ``least`` tokens
    (its turn has not come)."""
    most = min(d.tokens, room)
    least = min(least, most)
    if least < 1:
        return 0, 0.0
    t = step_seconds(cost, step)
    extra = lambda n: step_seconds(cost, step + [(d, n)]) - t      # noqa: E731
    if extra(least) > credit:
        return 0, 0.0
    n = largest_within(least, most, lambda n: extra(n) <= credit)
    return n, extra(n)
