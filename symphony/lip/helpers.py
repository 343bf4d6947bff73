"""Building blocks of the LIP standard library (the stock programs in userland/ use them).

* `generate(f, tokens, max_tokens, sampler, stop, on_text)`: the common decode loop;
* `StopChecker`: stop strings on streamed text, across token boundaries;
* `StreamText`: incremental detokenization with the model's tokenizer;
* `chat_prompt(messages)`: token ids of a conversation, by the model's chat template;
* `fork_join(prefix, fn, items)`: fork a KV prefix per item and run ``fn`` in threads.
"""
from __future__ import annotations

# argparse, and the modules it imports lazily (shutil for the help width, locale
# through gettext), are imported here so that the zygote, which preloads this
# module, preloads them too: LIPs parse main's arguments with argparse.
import argparse  # noqa: F401
import locale  # noqa: F401
import shutil  # noqa: F401
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Optional, Sequence

from symphony.tokenizer import StreamDecoder

from .runtime import KVFile, pred, tokenizer
from .sampling import Sampler

__all__ = ["StopChecker", "StreamText", "chat_prompt", "fork_join", "generate"]


class StopChecker:
    """Watch streamed text for stop strings.

    ``push(text) -> (emit, stop)``: ``emit`` is the text safe to show now;
    ``stop`` is True once a stop string has appeared (``emit`` then ends right
    before it, and later pushes return ``("", True)``; `hit` is the stop string
    found first, `rest` the text from its start on).  Text that could be the
    beginning of a stop string is held back until it is known not to be, so a
    partial stop string is never emitted; `flush()` returns what is held back
    when the stream ends without a stop.
    """

    def __init__(self, stop_strings: Iterable[str] = ()):
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        self.stops = list(stop_strings)
        if not all(isinstance(s, str) and s for s in self.stops):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stops!r}")
        self.held, self.stopped = "", False
        self.hit: Optional[str] = None
        self.rest = ""

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self.held + text
        hits = [(i, -len(s), s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            at, _, self.hit = min(hits)                   # the earliest; the longest there
            self.held, self.stopped, self.rest = "", True, buf[at:]
            return buf[:at], True
        keep = 0                                  # longest tail of buf that begins a stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        held, self.held = ("" if self.stopped else self.held), ""
        return held


class StreamText(StreamDecoder):
    """`symphony.tokenizer.StreamDecoder` on the LIP's tokenizer:
    ``push(token_id) -> new text`` (held back while it ends in an incomplete
    UTF-8 sequence), ``flush() -> the rest``."""

    def __init__(self, tok=None, *, skip_special: bool = True):
        super().__init__(tok if tok is not None else tokenizer(), skip_special=skip_special)


def chat_prompt(messages, *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` ([{"role", "content"}], or one user message as
    a str) rendered by the model's chat template, ending with the assistant's
    turn opener when ``add_generation_prompt``."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return tokenizer().encode_chat(messages, add_generation_prompt=add_generation_prompt)


def fork_join(prefix_file: KVFile, fn: Callable[[KVFile, object], object], items: Iterable,
              max_workers: Optional[int] = None) -> list:
    """For each item, fork ``prefix_file`` (copy-on-write) and run ``fn(fork, item)``
    in a thread; the forks are closed afterwards.  Returns the results in the
    order of ``items`` (the first exception is raised).  Threads' pred calls
    share the kernel's forward passes; a LIP has 8 call slots, hence the default
    of at most 8 workers."""
    items = list(items)

    def one(item):
        with prefix_file.fork() as f:
            return fn(f, item)
    with ThreadPoolExecutor(max_workers or max(1, min(len(items), 8))) as pool:
        return list(pool.map(one, items))


def generate(f: KVFile, tokens: Sequence[int], max_tokens: int, sampler: Optional[Sampler] = None,
             stop: Iterable[str] = (), on_text: Optional[Callable[[str], None]] = None
             ) -> tuple[str, list[int]]:
    """Append ``tokens`` to ``f`` and decode up to ``max_tokens`` tokens.

    Greedy (no sampler, or a `Sampler` whose `greedy` is true) lets the kernel
    pick the argmax; otherwise the logits come back and ``sampler`` chooses
    (its repetition penalty sees ``tokens`` and the tokens generated).  Stops
    at an end-of-sequence token (not included), at a stop string (the text
    ends before it) or after ``max_tokens``.  ``on_text(chunk)`` gets the text
    as it is produced.  Returns ``(text, token_ids)``.  ``f`` then holds
    ``tokens`` and the generated ids except the last one when decoding ended
    at ``max_tokens`` or a stop string (it was never fed back): use ``len(f)``.
    """
    tok, sampler = tokenizer(), sampler or Sampler(temperature=0)
    stream, stops = StreamText(tok), StopChecker(stop)
    text, ids, history = [], [], list(tokens)

    def emit(s: str) -> None:
        if s:
            text.append(s)
            if on_text:
                on_text(s)
    t = list(tokens)
    for _ in range(max_tokens):
        if sampler.greedy:
            nxt = pred(f, t, output="argmax")             # chosen in the kernel: no logits cross
        else:
            nxt = sampler.sample(pred(f, t), history)
        if nxt in tok.eos_ids:
            break
        ids.append(nxt)
        history.append(nxt)
        chunk, done = stops.push(stream.push(nxt))
        emit(chunk)
        if done:
            break
        t = [nxt]
    if not stops.stopped:
        chunk, _ = stops.push(stream.flush())
        emit(chunk + stops.flush())
    return "".join(text), ids
