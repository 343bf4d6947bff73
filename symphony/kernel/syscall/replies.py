"""Replies that do not fit a ring slot, and error messages that must.

A reply body larger than a slot (``slot_bytes - 32``) travels in chunks::

    LIP                                   kernel (syscall thread)
    call(op, body)           ------->     handler -> reply of N bytes > slot room
                             <-------     status CHUNKED, {"chunked": id, "size": N}
                                          (the N encoded bytes kept in the LIP's ReplyStore)
    call(FETCH, {"id", "offset": 0})  ->
                             <-------     status OK, the raw bytes [0, room)
    ... until offset == N                 the last chunk frees the bytes
    orjson.loads(all chunks)

A LIP's unfetched replies are bounded (`MAX_PENDING_REPLY_BYTES`, a reply past
it fails with ENOBUFS) and freed when fetched or when the LIP exits.  Error
messages are cut to `MAX_ERROR_CHARS` with a marker, so an error always fits.
"""
from __future__ import annotations

MAX_PENDING_REPLY_BYTES = 8 << 20       # per LIP: unfetched chunked replies
MAX_ERROR_CHARS = 4000                  # an error message is cut past this many characters


class ReplyStore:
    """One LIP's encoded replies awaiting FETCH (owned by the syscall thread)."""

    __slots__ = ("limit", "items", "total", "next_id")

    def __init__(self, limit: int = MAX_PENDING_REPLY_BYTES):
        self.limit = limit
        self.items: dict[int, bytes] = {}
        self.total = 0
        self.next_id = 1

    def put(self, data: bytes) -> int:
        """Keep ``data``; returns its id.  OverflowError past the LIP's bound."""
        if self.total + len(data) > self.limit:
            raise OverflowError(f"a reply of {len(data)} bytes does not fit: this LIP already has "
                                f"{self.total} bytes of unfetched replies (at most {self.limit})")
        rid = self.next_id
        self.next_id += 1
        self.items[rid] = data
        self.total += len(data)
        return rid

    def take(self, rid: int, offset: int, n: int) -> bytes:
        """Bytes [offset, offset+n) of reply ``rid``; the reply is freed once
        its last byte is taken.  KeyError / IndexError for a bad id / offset."""
        data = self.items.get(rid)
        if data is None:
            raise KeyError(f"no pending reply {rid}")
        if not 0 <= offset < len(data):
            raise IndexError(f"offset {offset} outside the reply's {len(data)} bytes")
        chunk = data[offset:offset + n]
        if offset + len(chunk) >= len(data):
            del self.items[rid]
            self.total -= len(data)
        return chunk

    def clear(self) -> None:
        self.items.clear()
        self.total = 0


def truncate_message(msg: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``msg`` cut to ``limit`` characters with a marker naming its full size."""
    if len(msg) <= limit:
        return msg
    return f"{msg[:limit]}… [truncated, {len(msg.encode('utf-8', 'replace'))} bytes]"
