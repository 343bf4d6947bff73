"""Stored responses (``store: true``) for ``GET /v1/responses/{id}`` and
``previous_response_id``.

Kept in the gateway's memory, per user, at most ``per_user`` responses and
``max_bytes`` bytes of them each (the oldest are dropped first), so one user
cannot fill it for others.  A stored response
holds the response object, its input items, and the whole conversation
(earlier turns, this input, this output) that a continuation starts from;
instructions are not carried into a continuation, as in OpenAI's API.  The
KV of the conversation lives in the serving program's prefix cache on the
kernel that served it (``kernel``; the continuation runs there), so a
continuation computes only its new input; when that kernel drains or dies and
the files move (moves.py), ``repin`` sends the continuations after them.  A
gateway restart forgets them.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import orjson


@dataclass
class Stored:
    user: str
    response: dict
    input_items: list
    conversation: list       # serve-contract messages, without instructions
    kernel: Optional[int] = None   # the kernel that served it (a continuation runs there)
    size: int = field(default=0, compare=False)


class ResponseStore:
    def __init__(self, per_user: int, max_bytes: int = 64 << 20):
        self.per_user, self.max_bytes = per_user, max_bytes
        self._by_user: dict[str, OrderedDict] = {}
        self._bytes: dict[str, int] = {}

    def put(self, rid: str, s: Stored) -> bool:
        """Keep ``s`` (dropping the user's oldest beyond the bounds); False if it
        alone is larger than a user's byte bound (then nothing is dropped)."""
        s.size = len(orjson.dumps([s.response, s.input_items, s.conversation]))
        if s.size > self.max_bytes:
            return False
        d = self._by_user.setdefault(s.user, OrderedDict())
        d[rid] = s
        self._bytes[s.user] = self._bytes.get(s.user, 0) + s.size
        while len(d) > self.per_user or self._bytes[s.user] > self.max_bytes:
            _, old = d.popitem(last=False)
            self._bytes[s.user] -= old.size
        return True

    def get(self, user: str, rid: str) -> Optional[Stored]:
        """The stored response ``rid`` of ``user`` (None for another user's: they look alike)."""
        return self._by_user.get(user, {}).get(rid)

    def users_pinned_to(self, kernel: int) -> list[str]:
        """The users with a stored response whose continuation runs on ``kernel``."""
        return sorted(u for u, d in self._by_user.items() if any(s.kernel == kernel for s in d.values()))

    def repin(self, user: str, old: int, new: int) -> int:
        """``user``'s stored responses on kernel ``old`` now continue on ``new`` (their KV
        files moved there); how many."""
        n = 0
        for s in self._by_user.get(user, {}).values():
            if s.kernel == old:
                s.kernel, n = new, n + 1
        return n

    def delete(self, user: str, rid: str) -> bool:
        old = self._by_user.get(user, {}).pop(rid, None)
        if old is None:
            return False
        self._bytes[user] -= old.size
        return True
