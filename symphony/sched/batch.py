"""Level 2: form each forward pass from the pending pred() calls of all LIPs.

Counting tokens, not phases (as vLLM v1 does): every pending call has
``remaining`` tokens to feed; a step takes at most ``token_budget`` tokens.

    schedule(now) -> Step | None
      1. each user's share of the step (share.py): one user alone gets the
         whole budget; when several users have ready calls, the step is kept
         within ``slowdown`` x the time of the even step (the lightest user's
         own work once for every user of the highest priority class present,
         priced as its own tokens), as predicted by the cost model of the
         steps timed so far (cost.py), and its tokens are split by weighted
         max-min between the users (weight 4^priority): one user's many
         sequences take turns in that user's share and make that user's
         steps slower, not everyone's; a user one token of whose would
         already break that (deep in a long prompt) sits out but for turns
         its credit pays for (`_shares`)
      2. within a user's share: calls with a single token left (decodes, last
         chunks) first, one token each, then multi-token calls (prefills), a
         long prompt in chunks of at most ``chunk_tokens`` (and of the share;
         fewer deep in a long prompt, `chunk_cap`, so a deep chunk's pass is
         no longer than a shallow one's), so a 10k-token prompt never stalls
         decoders for a whole prefill;
         decodes in turns between the user's LIPs (the LIP served the fewest
         tokens first), then arrival; prefills first come, first served, a
         prompt already begun before any other (its chunks follow each other),
         so that of N prompts arriving together the first is answered after
         its own prefill, not after all N (time to first token).
    A call appears at most once per step; calls on the same KV file wait for
    the earlier one (their order matters).  Calls of a `held` LIP (suspended,
    or waiting for device pages: sched/memory.py decides) stay queued and are
    not scheduled until it is released.

The queue has one writer, this class: `add`, `schedule`, and the verbs
`hold` (who waits this step), `drop` (a call that failed), `fail_lip` (take
a LIP's calls out to fail them) and `drop_lip` (a LIP exited).

Launch-or-gather: the caller runs a step at once when the device is idle and
the queue already holds as many calls as the previous step had, otherwise it
may wait up to ``gather_s`` for the last step's callers to come back (sibling
threads of one LIP answer within microseconds) - `should_wait`; not for the
callers of a user whose share of the last step left some of its calls out
(its next step is full without them).

Pure Python, no torch: the kernel hands it opaque requests and runs the steps.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

from .cost import StepCost, attention_pairs, attention_reads
from .share import Demand, allowance, capacity, deferred, largest_within, split, step_seconds, weight

SLOWDOWN = 1.5              # a shared step: at most 1.5x the even step at its lightest user's level (share.py)
MIN_CHUNK = 32              # the smallest prompt chunk `chunk_cap` cuts to
CHUNK_SLACK = 1.25          # a deep chunk may cost this much more than a full one at a prompt's start


@dataclass
class Call:
    """One pending pred() call."""

    key: Hashable                # the KV file it writes (calls on one file run in order)
    lip: int
    user: str
    n_tokens: int
    priority: int = 0            # higher runs first
    payload: Any = None          # the kernel's own record
    arrival: float = 0.0
    done: int = 0                # tokens already fed (chunked prefill)
    context: int = 0             # KV slots in its file before its first token (the attention it reads)
    seq: int = field(default_factory=itertools.count().__next__)

    @property
    def remaining(self) -> int:
        return self.n_tokens - self.done


@dataclass
class Step:
    """One forward pass: (call, start, count) slices; ``final`` calls reply after it."""

    items: list[tuple[Call, int, int]]

    @property
    def tokens(self) -> int:
        return sum(n for _, _, n in self.items)

    def final(self) -> list[Call]:
        return [c for c, s, n in self.items if s + n == c.n_tokens]


class BatchScheduler:
    def __init__(self, token_budget: int = 2048, chunk_tokens: int = 512, gather_s: float = 0.003,
                 slowdown: float = SLOWDOWN, cost: Optional[StepCost] = None):
        """``slowdown``: how much slower than the even step at its lightest
        user's level a shared step may be (share.py); ``cost``: the step-cost
        model (default: one that learns from `took`)."""
        if token_budget < 1 or chunk_tokens < 1:
            raise ValueError("token_budget and chunk_tokens must be >= 1")
        if not slowdown >= 1.0:
            raise ValueError("slowdown must be >= 1")
        self.token_budget, self.chunk_tokens, self.gather_s = token_budget, chunk_tokens, gather_s
        self.slowdown = slowdown
        self.cost = cost if cost is not None else StepCost()
        self._last_size: Optional[tuple[int, int, float]] = None  # (tokens, calls, pairs) of the last step
        self.queue: list[Call] = []
        self.served_user: dict[str, int] = defaultdict(int)
        self.served_lip: dict[int, int] = defaultdict(int)
        self.last_step_keys: dict = {}                    # callers of the last step: key -> lip
        self._gather_deadline: Optional[float] = None
        self._held: set[int] = set()                      # LIPs whose calls wait (memory): `held`
        self._missing: Optional[set] = set()              # last step's keys not queued again (None: recount)
        self.credit: dict[tuple, float] = {}              # seconds a sitting-out user has earned

    # ------------------------------------------------------------------ queue
    def add(self, call: Call) -> None:
        if call.n_tokens < 1:
            raise ValueError("a call needs at least one token")
        self.queue.append(call)
        if self._missing:
            self._missing.discard(call.key)

    def drop_lip(self, lip: int) -> list[Call]:
        """Forget a LIP's calls (it exited); returns them."""
        gone = self.fail_lip(lip)
        self.served_lip.pop(lip, None)
        self.held.discard(lip)
        self.last_step_keys = {k: l for k, l in self.last_step_keys.items() if l != lip}
        self._missing = None
        return gone

    def fail_lip(self, lip: int) -> list[Call]:
        """Take a LIP's queued calls out (the caller answers them with an
        error); the LIP itself stays known.  Returns them, in queue order."""
        gone = [c for c in self.queue if c.lip == lip]
        if gone:
            self.queue = [c for c in self.queue if c.lip != lip]
            self._missing = None
        return gone

    def drop(self, call: Call) -> None:
        """Take one call out (it failed: its remaining chunks never run)."""
        self.queue = [c for c in self.queue if c is not call]
        self._missing = None

    @property
    def held(self) -> set:
        """The LIPs whose calls wait this step (`hold`)."""
        return self._held

    @held.setter
    def held(self, lips: set) -> None:
        self._held = lips
        self._missing = None

    def hold(self, lips) -> None:
        """The LIPs whose calls wait this step (memory: sched/memory.py decides);
        every other LIP is released."""
        lips = set(lips)
        if lips != self._held:
            self.held = lips

    def took(self, seconds: float) -> None:
        """The last step's forward pass took ``seconds``: the cost model learns
        it (cost.py), and the step waits for its late callers at most a quarter
        of that (and at most 50 ms), `should_wait`."""
        self.gather_s = min(0.050, 0.25 * seconds)
        if self._last_size is not None:
            tokens, calls, pairs, reads = self._last_size
            self.cost.observe(tokens, calls, seconds, pairs, reads)
            self._last_size = None

    def predicted_seconds(self) -> Optional[float]:
        """What the cost model predicts the step just scheduled takes on the device (None: no
        step scheduled since the last `took`, or too few steps observed to predict)."""
        if self._last_size is None:
            return None
        return self.cost.seconds(*self._last_size)

    def next_chunk(self, c: Call) -> int:
        """Tokens of call ``c``'s next chunk, before any user's share: its last token alone, or
        what is left of its prompt within `chunk_cap` and the token budget. The memory planner
        (`next_chunks`), the demands and the step all cut it so."""
        if c.remaining == 1:
            return 1
        return min(c.remaining, self.chunk_cap(c.context + c.done), self.token_budget)

    def chunk_cap(self, context: int) -> int:
        """The most tokens of a prompt one pass feeds after ``context`` cached ones:
        ``chunk_tokens``, fewer deep in a long prompt, where each token's attention reads the
        whole context before it: as many as the cost model predicts to cost no more than
        CHUNK_SLACK x ``chunk_tokens`` at the prompt's start (tokens and attention: pairs and keys
        read; the slack leaves prompts of ordinary length whole; never fewer than MIN_CHUNK). So a
        pass of one user's deep chunk - which anyone arriving meanwhile waits for - is no longer
        than a shallow one; the prompt's own total work is the same."""
        c = self.chunk_tokens
        if not self.cost.steps or context <= 0:
            return c
        _, _, _, per_kpair, per_kread = self.cost.coefficients()
        if per_kpair <= 0.0 and per_kread <= 0.0:
            return c
        base = self.cost.seconds(0, 0)

        def price(ctx: int, n: int) -> float:               # a chunk's own part of a pass
            return self.cost.seconds(n, 0, attention_pairs(ctx, n), attention_reads(ctx, n)) - base
        limit = CHUNK_SLACK * price(0, c)
        return largest_within(min(c, MIN_CHUNK), c, lambda n: price(context, n) <= limit)

    def queued_lips(self) -> set[int]:
        """LIPs with a queued call."""
        return {c.lip for c in self.queue}

    def __len__(self) -> int:
        return len(self.queue)

    def runnable(self) -> int:
        """Queued calls that are not held."""
        return sum(1 for c in self.queue if c.lip not in self.held)

    def next_chunks(self) -> dict:
        """For each LIP with runnable-or-held calls: [(call, tokens of its next
        chunk)], the first call of each KV file only (the others wait for it):
        what the memory planner must find pages for before a step."""
        out: dict = {}
        seen = set()
        for c in self.queue:
            if c.key in seen:
                continue
            seen.add(c.key)
            n = self.next_chunk(c)
            out.setdefault(c.lip, []).append((c, n))
        return out

    # ------------------------------------------------------------------ decisions
    def should_wait(self, now: float) -> bool:
        """Hold the step briefly while some caller of the last step (a KV file
        that was fed) has not come back yet.  Waiting for those callers, not
        for as many calls as the last step had, matters: calls that missed a
        step are queued when the next one forms, and a count would launch it
        as soon as that many are there - leaving as many stragglers behind,
        step after step."""
        if not self.queue:
            self._gather_deadline = None
            return False
        if self._missing is None:          # recounted after the queue lost calls or the holds changed;
            queued = {c.key for c in self.queue}      # else kept by `add` (once a call: not per poll)
            self._missing = {k for k, lip in self.last_step_keys.items() if lip not in self.held and k not in queued}
        if not self._missing:
            self._gather_deadline = None
            return False
        if self._gather_deadline is None:
            self._gather_deadline = now + self.gather_s
        return now < self._gather_deadline

    def gather_left(self, now: float) -> float:
        """Seconds `should_wait` still holds the step (0: launch now)."""
        return max(0.0, self._gather_deadline - now) if self.should_wait(now) else 0.0

    def schedule(self, now: float = 0.0) -> Optional[Step]:
        """The next step, or None if no call is ready (none queued, or every
        queued one held).  Calls fully fed by the step leave the queue;
        partly fed ones stay with ``done`` advanced."""
        if not self.queue:
            return None
        demands, calls = self._demands()
        if not demands:
            return None
        shares = self._shares(demands)
        decodes, prefills, cut = [], [], set()
        for d in demands:                                 # share.py ordered them: served least first
            left = shares.get(d.key, 0)
            if left < d.tokens:
                cut.add(d.key)
            for c in calls[d.key]:
                if left <= 0:
                    break
                n = min(self.next_chunk(c), left)
                (decodes if c.remaining == 1 else prefills).append((c, c.done, n))
                left -= n
        items = decodes + prefills
        for c, _, n in items:
            c.done += n
            self.served_user[c.user] += n
            self.served_lip[c.lip] += n
        self.queue = [c for c in self.queue if c.remaining > 0]
        # the callers worth waiting for: those of users whose share took all their ready calls
        # (a user cut short has calls left for the next step; its stragglers hold nothing up)
        self.last_step_keys = {c.key: c.lip for c, _, _ in items if (c.priority, c.user) not in cut}
        self._missing = None
        self._last_size = (sum(n for _, _, n in items), len(items),
                           sum(attention_pairs(c.context + start, n) for c, start, n in items),
                           sum(attention_reads(c.context + start, n) for c, start, n in items))
        self._gather_deadline = None
        return Step(items)

    def _shares(self, demands: list[Demand]) -> dict[tuple, int]:
        """Tokens per user (demand key) in this step (share.py): the users who would slow the
        lightest one's step past ``slowdown`` by their least part (`deferred`: a token deep in a
        long prompt) sit out, each earning (slowdown - 1) x the predicted time of each step it
        misses (split between those sitting out by weight); the others share the step
        (`capacity`, `split`); a sitting-out user comes in, once its credit covers at least
        MIN_CHUNK tokens of its next chunk (or the whole of a shorter one), with as many tokens
        as its credit pays for, and spends that."""
        out = deferred(demands, self.cost, self.slowdown)
        self.credit = {k: v for k, v in self.credit.items() if k in out}
        inner = [d for d in demands if d.key not in out]
        shares = split(inner, capacity(inner, self.token_budget, self.cost, self.slowdown))
        if not out:
            return shares
        step = [(d, shares[d.key]) for d in inner]
        late = [d for d in demands if d.key in out]
        t = step_seconds(self.cost, step)
        wsum = sum(weight(d.priority) for d in late)
        for d in late:                                    # highest class first, served least first
            credit = self.credit.get(d.key, 0.0) + (self.slowdown - 1.0) * t * weight(d.priority) / wsum
            room = self.token_budget - sum(n for _, n in step)
            n, spent = allowance(d, credit, MIN_CHUNK, room, self.cost, step)
            if n:
                credit -= spent
                step.append((d, n))
                shares[d.key] = n
            full = step_seconds(self.cost, [(d, min(d.tokens, self.token_budget))])
            self.credit[d.key] = min(max(credit, 0.0), full)  # never more than its largest turn
        return shares

    def _demands(self) -> tuple[list[Demand], dict[tuple, list[Call]]]:
        """Each user's ready calls, one per KV file (the earliest: calls on a
        file run in order), decodes first, each group in turns between the
        user's LIPs (the LIP served least first, then arrival); and the
        matching `Demand`s, the user served least (tokens / weight) first."""
        seen: set = set()
        by_user: dict[tuple, list[Call]] = defaultdict(list)
        for c in self.queue:
            if c.lip in self.held or c.key in seen:
                continue
            seen.add(c.key)
            by_user[(c.priority, c.user)].append(c)
        demands, calls = [], {}
        for (prio, user), cs in by_user.items():
            turn: dict[int, int] = defaultdict(int)     # the k-th call of a LIP waits k turns
            keyed = []
            for c in cs:
                if c.remaining == 1:                    # decodes: in turns between the user's LIPs
                    keyed.append((False, self.served_lip.get(c.lip, 0) + turn[c.lip], c.arrival, c.seq, c))
                    turn[c.lip] += 1
                else:                                   # prefills: a begun one first, then first come
                    keyed.append((True, 0 if c.done else 1, c.arrival, c.seq, c))
            ordered = [k[-1] for k in sorted(keyed, key=lambda k: k[:4])]
            calls[(prio, user)] = ordered
            items = [self.next_chunk(c) for c in ordered]
            demands.append(Demand(user, prio, items, self.served_user.get(user, 0),
                                  [c.context + c.done for c in ordered]))
        demands.sort(key=lambda d: (-d.priority, d.served / weight(d.priority), d.user))
        return demands, calls
