"""Control characters out of everything the kernel shows: log lines, `ps`, error messages.

A LIP's program name and arguments, a client's paths and input, an exception
that quotes them: any of it may hold a newline (a forged log line, a forged
`ps` row), an ANSI escape (a recoloured or cleared terminal), a carriage
return or a bidirectional override (text that reads differently than it is).
Wherever such text is shown it goes through `printable`, which writes each
of those characters as a visible escape (``\\n``, ``\\x1b``, ``\\u202e``) and
leaves everything else (UTF-8 text, quotes, backslashes) as it is.

`SafeFormatter` is the kernel's log formatter: the message of every record
is made printable, and so is the message of a logged exception (the
traceback's own line breaks stay).
"""
from __future__ import annotations

import logging
import re
import traceback

# C0 controls, DEL, C1 controls, line/paragraph separators, bidi embeddings,
# overrides and isolates
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match) -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def printable(text) -> str:
    """``text`` (any object: str() of it) with every control character escaped."""
    s = text if isinstance(text, str) else str(text)
    return _CONTROL.sub(_escape, s) if _CONTROL.search(s) else s


class SafeFormatter(logging.Formatter):
    """A `logging.Formatter` whose lines hold no control character from their data:
    one record is one line (plus a traceback's own lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        te = traceback.TracebackException(*ei)
        seen = set()
        todo = [te]
        while todo:                                # the exception and its causes / contexts
            t = todo.pop()
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            if isinstance(getattr(t, "_str", None), str):
                t._str = printable(t._str)
            todo += [t.__cause__, t.__context__]
        return "".join(te.format()).rstrip("\n")
