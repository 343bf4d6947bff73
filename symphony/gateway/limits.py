"""What one key, and the gateway as a whole, may have in flight.

* per key: a request rate (a token bucket of ``rpm`` requests, refilled at
  rpm/60 a second) and a number of requests running at once
  (``max_concurrent``: each holds a LIP or a stream); past either, 429 with
  ``Retry-After``;
* the gateway: requests running at once, all keys (``max_active``); past it,
  503 with ``Retry-After`` (the kernel's own admission queue bounds what it
  queues beyond that; a full queue is a 503 too).

`Limiter.acquire(key)` admits a request; its slot is released when the
request has ended, streamed answers included.  Everything runs on the gateway's event loop.

Refusals cost the gateway too: a client that ignores ``Retry-After`` and asks
again at once, from many connections, would keep the event loop busy answering
401 and 429 and slow every other client.  So beyond `FREE_REFUSALS` refusals
in a second to one key (a 429) or one client address (a 401), each further
refusal is answered only after `REFUSAL_DELAY_S` (`Limiter.refused`): such a
client then gets a few answers a second per connection, and the connections
one address may hold are bounded at the front door (frontdoor.py).

A route that holds something for a key for a long time (a stream, a
WebSocket session) takes a slot with `acquire` when it starts and releases it
when it ends, so the key's ``max_concurrent`` bounds those too.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

FREE_REFUSALS = 5           # refusals a second one key or address gets at once
REFUSAL_DELAY_S = 0.5       # beyond: each refusal waits this long

from .errors import ApiError


@dataclass
class _Bucket:
    tokens: float
    stamp: float = field(default_factory=time.monotonic)
    active: int = 0


class Limiter:
    def __init__(self, max_active: int):
        if max_active < 1:
            raise ValueError("max_active must be >= 1")
        self.max_active = max_active
        self.active = 0
        self._keys: dict[str, _Bucket] = {}
        self._refusals: dict[str, deque] = {}           # key name or "addr:IP" -> the last refusals' times
        self.delayed = 0                                # refusals answered after REFUSAL_DELAY_S

    def _bucket(self, name: str, rpm: int) -> _Bucket:
        b = self._keys.get(name)
        now = time.monotonic()
        if b is None:
            b = self._keys[name] = _Bucket(float(rpm), now)
        else:
            b.tokens = min(float(rpm), b.tokens + (now - b.stamp) * rpm / 60.0)
            b.stamp = now
        return b

    def acquire(self, name: str, rpm: int, max_concurrent: int) -> "Slot":
        """Admit one request of key ``name`` (ApiError 429/503 if it may not run
        now); the returned slot is released when the request has ended."""
        b = self._bucket(name, rpm)
        if b.active >= max_concurrent:
            raise ApiError(429, f"this key has {b.active} requests running, its limit is {max_concurrent}; "
                                f"retry when one ends", code="concurrency_limit_exceeded", retry_after=1)
        if b.tokens < 1:
            raise ApiError(429, f"this key's rate limit is {rpm} requests per minute", code="rate_limit_exceeded",
                           retry_after=(1 - b.tokens) * 60.0 / rpm)
        if self.active >= self.max_active:
            raise ApiError(503, f"the gateway is serving {self.active} requests, its most "
                                f"(symphony-gateway --max-active {self.max_active}); retry shortly",
                           code="overloaded", retry_after=1)
        b.tokens -= 1
        b.active += 1
        self.active += 1
        return Slot(self, b)


    async def refused(self, who: str) -> None:
        """A request of ``who`` (a key's name, or ``addr:IP`` before a key is
        known) is being refused: wait `REFUSAL_DELAY_S` first if ``who`` was
        refused more than `FREE_REFUSALS` times within the last second."""
        now = time.monotonic()
        if len(self._refusals) > 4096:                  # forget who has not been refused for a second
            self._refusals = {w: d for w, d in self._refusals.items() if now - d[-1] < 1.0}
        d = self._refusals.setdefault(who, deque(maxlen=FREE_REFUSALS))
        late = len(d) == FREE_REFUSALS and now - d[0] < 1.0
        d.append(now)
        if late:
            self.delayed += 1
            await asyncio.sleep(REFUSAL_DELAY_S)


class Slot:
    """One admitted request; `release` (idempotent) when it has ended."""

    def __init__(self, limiter: Limiter, bucket: _Bucket):
        self._limiter, self._bucket = limiter, bucket

    def release(self) -> None:
        if self._bucket is not None:
            self._bucket.active -= 1
            self._limiter.active -= 1
            self._bucket = None
