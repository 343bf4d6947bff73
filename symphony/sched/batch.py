"""Level 2: form each forward pass from the pending pred() calls of all LIPs.

Counting tokens, not phases (as vLLM v1 does): every pending call has
``remaining`` tokens to feed; a step takes at most ``token_budget`` tokens.

    schedule(now) -> Step | None
      1. calls with a single token left (decodes, last chunks) go first: one
         token each keeps every decoder moving every step
      2. then multi-token calls (prefills) fill what is left of the budget, a
         long prompt in chunks of at most ``chunk_tokens``, so a 10k-token
         prompt never stalls 32 decoders for a whole prefill
      within each group the order is: priority class (higher first), then the
      user and then the LIP that has been served the fewest tokens (fair
      share between users first, then between one user's LIPs), then arrival.
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
threads of one LIP answer within microseconds) - `should_wait`.

Pure Python, no torch: the kernel hands it opaque requests and runs the steps.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional


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
    def __init__(self, token_budget: int = 2048, chunk_tokens: int = 512, gather_s: float = 0.003):
        if token_budget < 1 or chunk_tokens < 1:
            raise ValueError("token_budget and chunk_tokens must be >= 1")
        self.token_budget, self.chunk_tokens, self.gather_s = token_budget, chunk_tokens, gather_s
        self.queue: list[Call] = []
        self.served_user: dict[str, int] = defaultdict(int)
        self.served_lip: dict[int, int] = defaultdict(int)
        self.last_step_keys: dict = {}                    # callers of the last step: key -> lip
        self._gather_deadline: Optional[float] = None
        self.held: set[int] = set()                       # LIPs whose calls wait (memory)

    # ------------------------------------------------------------------ queue
    def add(self, call: Call) -> None:
        if call.n_tokens < 1:
            raise ValueError("a call needs at least one token")
        self.queue.append(call)

    def drop_lip(self, lip: int) -> list[Call]:
        """Forget a LIP's calls (it exited); returns them."""
        gone = self.fail_lip(lip)
        self.served_lip.pop(lip, None)
        self.held.discard(lip)
        self.last_step_keys = {k: l for k, l in self.last_step_keys.items() if l != lip}
        return gone

    def fail_lip(self, lip: int) -> list[Call]:
        """Take a LIP's queued calls out (the caller answers them with an
        error); the LIP itself stays known.  Returns them, in queue order."""
        gone = [c for c in self.queue if c.lip == lip]
        if gone:
            self.queue = [c for c in self.queue if c.lip != lip]
        return gone

    def drop(self, call: Call) -> None:
        """Take one call out (it failed: its remaining chunks never run)."""
        self.queue = [c for c in self.queue if c is not call]

    def hold(self, lips) -> None:
        """The LIPs whose calls wait this step (memory: sched/memory.py decides);
        every other LIP is released."""
        self.held = set(lips)

    def took(self, seconds: float) -> None:
        """The last step's forward pass took ``seconds``: wait for its late
        callers at most a quarter of that (and at most 50 ms), `should_wait`."""
        self.gather_s = min(0.050, 0.25 * seconds)

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
            n = c.remaining if c.remaining == 1 else min(c.remaining, self.chunk_tokens, self.token_budget)
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
        queued = {c.key for c in self.queue}
        back = {k for k, lip in self.last_step_keys.items() if lip not in self.held}
        if back <= queued:
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
        budget, items, busy = self.token_budget, [], set()
        user_acc = dict(self.served_user)                 # provisional, as the step fills
        lip_acc = dict(self.served_lip)
        ready = [c for c in self.queue if c.lip not in self.held]
        decodes = [c for c in ready if c.remaining == 1]
        prefills = [c for c in ready if c.remaining > 1]
        for group, chunked in ((decodes, False), (prefills, True)):
            for c in self._fair_order(group, user_acc, lip_acc, chunked, busy):
                if budget <= 0:
                    break
                n = min(c.remaining, self.chunk_tokens, budget) if chunked else 1
                items.append((c, c.done, n))
                busy.add(c.key)
                budget -= n
                user_acc[c.user] = user_acc.get(c.user, 0) + n
                lip_acc[c.lip] = lip_acc.get(c.lip, 0) + n
        if not items:
            return None
        for c, _, n in items:
            c.done += n
            self.served_user[c.user] += n
            self.served_lip[c.lip] += n
        self.queue = [c for c in self.queue if c.remaining > 0]
        self.last_step_keys = {c.key: c.lip for c, _, _ in items}
        self._gather_deadline = None
        return Step(items)

    def _fair_order(self, calls, user_acc, lip_acc, chunked, busy):
        """Calls in scheduling order: higher priority first; within a priority,
        always the next call of the user served least so far (counting what this
        step has already given), that user's calls by their LIP's share, then
        arrival.  A generator, so the accounting updates as the step fills."""
        by_prio: dict[int, dict[str, list[Call]]] = defaultdict(lambda: defaultdict(list))
        for c in calls:
            by_prio[c.priority][c.user].append(c)
        for prio in sorted(by_prio, reverse=True):
            users = by_prio[prio]
            for lst in users.values():
                lst.sort(key=lambda c: (lip_acc.get(c.lip, 0), c.arrival, c.seq), reverse=True)
            while users:
                user = min(users, key=lambda u: (user_acc.get(u, 0), u))
                lst = users[user]
                c = lst.pop()
                if not lst:
                    del users[user]
                if c.key in busy:
                    continue
                yield c
                if lst:                                     # the LIP shares may have moved
                    lst.sort(key=lambda c: (lip_acc.get(c.lip, 0), c.arrival, c.seq), reverse=True)
