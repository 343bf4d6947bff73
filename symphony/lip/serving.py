"""The serving program's side of its contract (declared in `symphony.ipc.serving`).

`Request.parse(text)` reads and checks the one JSON argument the gateway
passes (raising `BadRequest` with the offending field); `Events` sends the
program's output events, each checked against the contract, one thread at a
time, and nothing after an error; for a request that is not streamed it
merges each choice's text into few events.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import orjson

from symphony.ipc import serving as contract

from .runtime import send

__all__ = ["BadRequest", "Events", "Request"]

HELD_BYTES = 32 << 10           # a merged event's size bound: well inside a 64 KiB ring slot


class BadRequest(ValueError):
    """A request the program refuses: status 400, an OpenAI error ``code`` and the ``param``."""

    def __init__(self, message: str, param: Optional[str] = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class Request:
    """A serving request (`symphony.ipc.serving.ServeRequest`, checked there) in the
    shapes the program uses: messages, tools and calls as dicts, defaults filled in,
    ``response_format`` the format struct (None for free text)."""
    mode: str
    messages: list = field(default_factory=list)
    prompt: Any = ""
    echo: bool = False
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list = field(default_factory=list)
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)        # token id -> bias
    response_format: Any = None
    tools: list = field(default_factory=list)
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    cache: Optional[dict] = None
    stream: bool = True
    count_only: bool = False

    @classmethod
    def parse(cls, text: str) -> "Request":
        """The program's argument, checked against the contract (BadRequest naming the field)."""
        try:
            c = contract.parse_request(text)
        except contract.ContractError as e:
            raise BadRequest(str(e), e.param or None) from None
        r = cls(mode=c.mode, max_tokens=c.max_tokens, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                min_p=c.min_p, seed=c.seed, stop=list(c.stop), n=c.n, logprobs=c.logprobs, top_logprobs=c.top_logprobs,
                presence_penalty=c.presence_penalty, frequency_penalty=c.frequency_penalty,
                logit_bias=dict(c.logit_bias), stream=c.stream, count_only=c.count_only)
        if c.mode == "chat":
            r.messages = [_message(m, i) for i, m in enumerate(c.messages)]
            r.tools = [{"name": t.name, "description": t.description or "",
                        "parameters": t.parameters if t.parameters is not None else {"type": "object"}}
                       for t in c.tools or ()]
            tc = c.tool_choice
            r.tool_choice = ({"name": tc.name} if isinstance(tc, contract.NamedTool) else
                             tc if tc not in (None, contract.UNSET) else "auto" if r.tools else "none")
            r.parallel_tool_calls = c.parallel_tool_calls is not False
        else:
            r.prompt, r.echo = c.prompt, c.echo is True
        fmt = c.response_format
        r.response_format = None if fmt is None or isinstance(fmt, contract.TextFormat) else fmt
        r.cache = None if c.cache is None else {"dir": c.cache.dir, "trust": list(c.cache.trust), "ttl": c.cache.ttl,
                                             "wait": c.cache.wait, "durable": c.cache.durable}
        return r


def _message(m, i: int) -> dict:
    out = {"role": m.role, "content": m.content or ""}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        if m.role != "assistant":
            raise BadRequest("tool_calls must be on an assistant message", f"messages[{i}].tool_calls")
        out["tool_calls"] = [{"id": x.id, "name": x.name, "arguments": x.arguments} for x in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


class Events:
    """Output events, sent whole from any thread; nothing after an ``error``.

    With ``coalesce`` (a request with ``stream`` false), a choice's first
    ``text`` or ``tool_call`` event goes at once (the gateway times the first
    token by it) and the pieces after it are held and merged: text with text
    (logprobs concatenated), a call's arguments with the same call's.  What
    is held goes out before the choice's next event of another kind (a call
    starting, ``done``), before an ``error``, at `flush`, or when the next
    piece would take it past ``HELD_BYTES``.  Concatenated, the events carry
    what the streamed ones would, in the same order.
    """

    def __init__(self, coalesce: bool = False):
        self.lock, self.failed, self.coalesce = threading.Lock(), False, coalesce
        self._held: dict = {}                         # choice index -> [event, its text pieces, size bound]
        self._started: set = set()                    # choices whose first piece has gone

    def send(self, ev: dict) -> bool:
        """Send ``ev`` (ContractError if it is no event of the contract: a bug here);
        False once an error was sent."""
        contract.check_event(ev)
        with self.lock:
            if self.failed:
                return False
            if self.coalesce:
                self._coalesce(ev)
            else:
                send(ev)
            return True

    def flush(self) -> None:
        """Send whatever is held."""
        with self.lock:
            if not self.failed:
                self._flush_all()

    def error(self, status: int, code: str, message: str, param: Optional[str] = None) -> None:
        with self.lock:
            if not self.failed:
                self._flush_all()
                self.failed = True
                send({"event": "error", "status": status, "code": code, "message": message, "param": param})

    # -- coalescing (under the lock)
    def _coalesce(self, ev: dict) -> None:
        kind, i = ev.get("event"), ev.get("index")
        if kind not in ("text", "tool_call"):
            self._flush(i)
            send(ev)
            return
        if i not in self._started:                    # the choice's first piece: at once
            self._started.add(i)
            send(ev)
            return
        held = self._held.get(i)
        if held is not None and _merges(held[0], ev):
            grown = held[2] + _piece_bytes(ev)
            if grown <= HELD_BYTES:
                held[1].append(ev["text" if kind == "text" else "arguments"])
                if "logprobs" in ev:
                    held[0].setdefault("logprobs", []).extend(ev["logprobs"])
                held[2] = grown
                return
        self._flush(i)
        h = dict(ev)
        if "logprobs" in h:
            h["logprobs"] = list(h["logprobs"])
        self._held[i] = [h, [h["text" if kind == "text" else "arguments"]], len(orjson.dumps(h))]

    def _flush(self, i) -> None:
        held = self._held.pop(i, None)
        if held is not None:
            ev, pieces, _ = held
            ev["text" if ev["event"] == "text" else "arguments"] = "".join(pieces)
            send(ev)

    def _flush_all(self) -> None:
        for i in list(self._held):
            self._flush(i)


def _piece_bytes(ev: dict) -> int:
    """At most the bytes merging ``ev`` adds to a held event's JSON."""
    if ev["event"] == "text":
        return len(orjson.dumps(ev["text"])) + len(orjson.dumps(ev.get("logprobs") or []))
    return len(orjson.dumps(ev["arguments"]))


def _merges(held: dict, ev: dict) -> bool:
    """Whether ``ev`` continues the held event: text after text, or more
    arguments of the call the held event is a piece of."""
    if ev["event"] == "text":
        return held["event"] == "text"
    return held["event"] == "tool_call" and "name" not in ev and held.get("call") == ev.get("call")
