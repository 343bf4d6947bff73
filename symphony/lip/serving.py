"""The request and event shapes of a serving program (userland/serve.py's contract).

`Request.parse(text)` reads and checks the one JSON argument the gateway
passes (raising `BadRequest` with the offending field); `Events` sends the
program's output events, one thread at a time, and nothing after an error;
for a request that is not streamed it merges each choice's text into few
events.  The contract itself is documented in userland/serve.py.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import orjson

from symphony.ipc import abi

from .runtime import send
from .tools import NAME

__all__ = ["BadRequest", "Events", "Request"]

ROLES = ("system", "developer", "user", "assistant", "tool")
HELD_BYTES = 32 << 10           # a merged event's size bound: well inside a 64 KiB ring slot
FORMATS = ("text", "json_object", "json_schema")
CACHE_WAIT_S = 30.0             # how long a request waits at most for a prefix another one is computing


class BadRequest(ValueError):
    """A request the program refuses: status 400, an OpenAI error ``code`` and the ``param``."""

    def __init__(self, message: str, param: Optional[str] = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class Request:
    mode: str
    messages: list = field(default_factory=list)
    prompt: Any = ""
    echo: bool = False
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: list = field(default_factory=list)
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    response_format: Optional[dict] = None
    tools: list = field(default_factory=list)
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    cache: Optional[dict] = None
    stream: bool = True

    @classmethod
    def parse(cls, text: str) -> "Request":
        try:
            d = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            raise BadRequest(f"the request is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise BadRequest("the request must be a JSON object")
        known = set(cls.__dataclass_fields__)
        for k in d:
            if k not in known:
                raise BadRequest(f"unknown field {k!r}", k)
        mode = d.get("mode")
        if mode not in ("chat", "text"):
            raise BadRequest("mode must be 'chat' or 'text'", "mode")
        r = cls(mode=mode)
        if mode == "chat":
            _absent(d, "prompt", "echo")
            r.messages = [_message(m, i) for i, m in enumerate(_list(d, "messages", 1, 100000))]
        else:
            _absent(d, "messages", "tools", "tool_choice", "parallel_tool_calls")
            r.prompt, r.echo = _prompt(d.get("prompt")), _bool(d, "echo", False)
        r.max_tokens = _int(d, "max_tokens", None, 1, 1 << 30, nullable=True)
        r.temperature = _num(d, "temperature", 1.0, 0.0, 2.0)
        r.top_p = _num(d, "top_p", 1.0, 0.0, 1.0, lo_open=True)
        r.seed = _int(d, "seed", None, -(1 << 63), (1 << 64) - 1, nullable=True)
        r.stop = [_str(s, f"stop[{i}]", nonempty=True) for i, s in enumerate(_list(d, "stop", 0, 4))]
        r.n = _int(d, "n", 1, 1, 16)
        r.logprobs = _bool(d, "logprobs", False)
        r.top_logprobs = _int(d, "top_logprobs", 0, 0, 20)
        if r.top_logprobs and not r.logprobs:
            raise BadRequest("top_logprobs needs logprobs", "top_logprobs")
        if r.echo and r.logprobs:
            raise BadRequest("echo together with logprobs is not supported", "echo")
        r.presence_penalty = _num(d, "presence_penalty", 0.0, -2.0, 2.0)
        r.frequency_penalty = _num(d, "frequency_penalty", 0.0, -2.0, 2.0)
        r.response_format = _format(d.get("response_format"))
        r.tools = [_tool(t, i) for i, t in enumerate(_list(d, "tools", 0, 1024))]
        if len({t["name"] for t in r.tools}) < len(r.tools):
            raise BadRequest("tool names must be unique", "tools")
        r.tool_choice = _tool_choice(d.get("tool_choice"), r.tools)
        r.parallel_tool_calls = _bool(d, "parallel_tool_calls", True)
        r.cache = _cache(d.get("cache"))
        r.stream = _bool(d, "stream", True)
        return r


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


# ---------------------------------------------------------------- field checks
def _absent(d, *keys):
    for k in keys:
        if k in d:
            raise BadRequest(f"{k!r} is not a field of mode {d['mode']!r}", k)


def _list(d, key, lo, hi):
    v = d.get(key)
    if v is None and lo == 0:
        return []
    if not isinstance(v, list) or not lo <= len(v) <= hi:
        raise BadRequest(f"{key} must be a list of {lo} to {hi} items", key)
    return v


def _bool(d, key, default):
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{key} must be true or false", key)
    return v


def _int(d, key, default, lo, hi, nullable=False):
    v = d.get(key, default)
    if v is None and (nullable or default is None):
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(f"{key} must be an integer in [{lo}, {hi}]", key)
    return v


def _num(d, key, default, lo, hi, lo_open=False):
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) \
            or not lo <= v <= hi or (lo_open and v == lo):
        raise BadRequest(f"{key} must be a number in {'(' if lo_open else '['}{lo}, {hi}]", key)
    return float(v)


def _str(v, param, nonempty=False):
    if not isinstance(v, str) or (nonempty and not v):
        raise BadRequest(f"{param} must be a {'non-empty ' if nonempty else ''}string", param)
    return v


def _prompt(v):
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return v
    raise BadRequest("prompt must be a string or a list of token ids", "prompt")


def _message(m, i):
    p = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise BadRequest(f"{p} must be an object whose role is one of {', '.join(ROLES)}", f"{p}.role")
    for k in m:
        if k not in ("role", "content", "name", "tool_calls", "tool_call_id"):
            raise BadRequest(f"unknown field {k!r} in {p}", f"{p}.{k}")
    out = {"role": m["role"], "content": _str(m.get("content") or "", f"{p}.content")}
    if m.get("name") is not None:
        out["name"] = _str(m["name"], f"{p}.name")
    if m.get("tool_calls"):
        if m["role"] != "assistant" or not isinstance(m["tool_calls"], list):
            raise BadRequest("tool_calls must be a list, on an assistant message", f"{p}.tool_calls")
        out["tool_calls"] = []
        for j, c in enumerate(m["tool_calls"]):
            q = f"{p}.tool_calls[{j}]"
            if not isinstance(c, dict):
                raise BadRequest(f"{q} must be an object", q)
            out["tool_calls"].append({"id": _str(c.get("id", ""), f"{q}.id"),
                                      "name": _str(c.get("name"), f"{q}.name", nonempty=True),
                                      "arguments": _str(c.get("arguments"), f"{q}.arguments")})
    if m.get("tool_call_id") is not None:
        out["tool_call_id"] = _str(m["tool_call_id"], f"{p}.tool_call_id")
    return out


def _format(v):
    if v is None:
        return None
    if not isinstance(v, dict) or v.get("type") not in FORMATS:
        raise BadRequest(f"response_format.type must be one of {', '.join(FORMATS)}", "response_format")
    if v["type"] == "text":
        return None
    if v["type"] == "json_object":
        return {"type": "object"}
    if not isinstance(v.get("schema"), dict):
        raise BadRequest("response_format json_schema needs a schema (an object)", "response_format.schema")
    return v["schema"]


def _tool(t, i):
    p = f"tools[{i}]"
    if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not NAME.fullmatch(t["name"]):
        raise BadRequest(f"{p}.name must be 1 to 64 letters, digits, '_' or '-'", f"{p}.name")
    params = t.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise BadRequest(f"{p}.parameters must be a JSON schema (an object)", f"{p}.parameters")
    return {"name": t["name"], "description": _str(t.get("description") or "", f"{p}.description"),
            "parameters": params or {"type": "object"}}


def _tool_choice(v, tools):
    if v is None:
        return "auto" if tools else "none"
    if v in ("auto", "none", "required"):
        if v == "required" and not tools:
            raise BadRequest("tool_choice 'required' needs tools", "tool_choice")
        return v
    if isinstance(v, dict) and isinstance(v.get("name"), str):
        if v["name"] not in {t["name"] for t in tools}:
            raise BadRequest(f"tool_choice names {v['name']!r}, which is not among the tools", "tool_choice")
        return {"name": v["name"]}
    raise BadRequest("tool_choice must be 'auto', 'none', 'required' or {\"name\": NAME}", "tool_choice")


def _cache(v):
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("dir"), str) or not v["dir"].startswith("/"):
        raise BadRequest("cache must be null or {\"dir\": ABSOLUTE_KVFS_DIR, \"trust\": [USER, ...]}", "cache.dir")
    trust = v.get("trust") or []
    if not isinstance(trust, list) or len(trust) > abi.MAX_TRUST \
            or not all(isinstance(u, str) and 0 < len(u) <= 32 for u in trust):
        raise BadRequest(f"cache.trust must be a list of at most {abi.MAX_TRUST} user names", "cache.trust")
    for k in v:
        if k not in ("dir", "trust", "ttl", "wait", "durable"):
            raise BadRequest(f"unknown field {k!r} in cache", f"cache.{k}")
    ttl = v.get("ttl", 3600)
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0):
        raise BadRequest("cache.ttl must be null or a number of seconds > 0", "cache.ttl")
    wait = v.get("wait", CACHE_WAIT_S)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= abi.MAX_LOOKUP_WAIT_S:
        raise BadRequest(f"cache.wait must be a number of seconds in [0, {abi.MAX_LOOKUP_WAIT_S:g}]", "cache.wait")
    if not isinstance(v.get("durable", False), bool):
        raise BadRequest("cache.durable must be true or false", "cache.durable")
    return {"dir": v["dir"], "trust": trust, "ttl": ttl, "wait": float(wait), "durable": v.get("durable", False)}
