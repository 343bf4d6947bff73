"""Stored responses (``store: true``) for ``GET /v1/responses/{id}`` and
``previous_response_id``.

Kept in the gateway's memory, per user, at most ``per_user`` each (the oldest
is dropped first), so one user cannot fill it for others.  A stored response
holds the response object, its input items, and the whole conversation
(earlier turns, this input, this output) that a continuation starts from;
instructions are not carried into a continuation, as in OpenAI's API.  The
KV of the conversation lives in the serving program's prefix cache, so a
continuation computes only its new input.  A gateway restart forgets them.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


@dataclass
class Stored:
    user: str
    response: dict
    input_items: list
    conversation: list       # serve-contract messages, without instructions


class ResponseStore:
    def __init__(self, per_user: int):
        self.per_user = per_user
        self._by_user: dict[str, OrderedDict] = {}

    def put(self, rid: str, s: Stored) -> None:
        d = self._by_user.setdefault(s.user, OrderedDict())
        d[rid] = s
        while len(d) > self.per_user:
            d.popitem(last=False)

    def get(self, user: str, rid: str) -> Optional[Stored]:
        """The stored response ``rid`` of ``user`` (None for another user's: they look alike)."""
        return self._by_user.get(user, {}).get(rid)

    def delete(self, user: str, rid: str) -> bool:
        return self._by_user.get(user, {}).pop(rid, None) is not None
