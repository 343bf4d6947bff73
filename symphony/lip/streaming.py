"""Generated tokens in, text safe to show out, with each token's record attached.

    ts = TextStream(tok, stops=["\\n\\n"])
    for t, lp in tokens:                   # lp: anything (a logprob entry), or None
        text, records = ts.push(t, lp)     # show `text`; `records` are its tokens' lp
        if ts.hit:
            break                          # ts.rest: the raw text from the stop on
    text, records = ts.finish()            # what was held back, at the end

Text is held back while it ends in an incomplete UTF-8 sequence or could be
the beginning of a stop string, so no event ever carries half a character or
any part of a stop string.  A token's record comes out with the text that
completes the token: a token whose bytes finish a character in the next
token's text comes out with that text.  When a stop string appears, the
records of the tokens that contributed any shown text come out with the last
text; `cut` is the index of the first token whose text reaches into the stop
string (the tokens before it produced only shown text) and `cut_text` the
part of that token's text before the stop string.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from symphony.tokenizer import StreamDecoder

from .helpers import StopChecker

__all__ = ["TextStream"]


class TextStream:
    """Incremental detokenization + stop strings + per-token records."""

    def __init__(self, tok, stops: Iterable[str] = ()):
        self.dec = StreamDecoder(tok)
        self.stops = StopChecker(stops)
        self.raw = 0                 # characters decoded so far
        self.shown = 0               # characters returned so far
        self.tokens = 0              # tokens pushed
        self.pending: list = []      # [index, record, start, end or None] of tokens not yet reported
        self.cut: Optional[int] = None
        self.cut_text = ""
        self._raw: list[str] = []    # the decoded text, in pieces

    @property
    def hit(self) -> Optional[str]:
        """The stop string that ended the text (None while it goes on)."""
        return self.stops.hit

    @property
    def rest(self) -> str:
        """After a hit: the raw text from the stop string's first character on."""
        return self.stops.rest

    def push(self, token: int, record: Any = None) -> tuple[str, list]:
        """Add one token; returns (text to show now, records of the tokens it completes)."""
        i = self.tokens
        self.tokens += 1
        if self.stops.stopped:
            return "", []
        self.pending.append([i, record, self.raw, None])
        return self._take(self.dec.push(token))

    def finish(self) -> tuple[str, list]:
        """The end of the stream: the text and records still held back."""
        if self.stops.stopped:
            return "", []
        text, records = self._take(self.dec.flush())
        if not self.stops.stopped:
            text += self.stops.flush()
            records += [p[1] for p in self.pending if p[1] is not None]
            self.pending = []
        return text, records

    def _take(self, piece: str) -> tuple[str, list]:
        if piece:
            self._raw.append(piece)
            self.raw += len(piece)
            for p in self.pending:
                if p[3] is None:
                    p[3] = self.raw
        text, stop = self.stops.push(piece)
        self.shown += len(text)
        if stop:                                        # report every token that showed a character
            out = [p for p in self.pending if p[2] < self.shown]
            cut = next((p for p in self.pending if p[3] is None or p[3] > self.shown), None)
            self.cut = cut[0] if cut else self.tokens
            self.cut_text = "".join(self._raw)[cut[2]:self.shown] if cut else ""
            self.pending = []
        else:
            out = [p for p in self.pending if p[3] is not None and p[3] <= self.shown]
            self.pending = self.pending[len(out):]
        return text, [p[1] for p in out if p[1] is not None]
