"""Tool calling for chat models whose template knows no tools: the Hermes/Qwen format.

The tools are listed in a system-prompt section (`system_section`), and a call is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(several calls: one block each, separated by a newline).  `render` turns an
OpenAI-style conversation into plain template messages: the tools section
joins the first system message, an assistant's earlier calls become such
blocks, and tool results become a user turn of ``<tool_response>`` blocks, so
the turn after a tool result continues the conversation in the format the
model was shown.  `calls_grammar` is the Lark grammar (llguidance) of one or
more calls whose arguments follow each tool's JSON schema; `CallParser` turns
the generated call text back into call events as it streams.
"""
from __future__ import annotations

import json
import re
from typing import Optional, Sequence

from .grammar import compact_schema
from .helpers import StopChecker

__all__ = ["MARKER", "NAME", "CallParser", "CallGuard", "call_text", "calls_grammar", "closed", "render",
           "system_section"]

MARKER = "<tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")           # OpenAI's function-name rule
_HEAD = MARKER + '\n{"name": '
_ARGS = ', "arguments": '
_END = "}\n</tool_call>"
ANY_OBJECT = {"type": "object"}


def call_text(name: str, arguments: str) -> str:
    """One call block, exactly as the grammar makes the model write it."""
    return f"{_HEAD}{json.dumps(name)}{_ARGS}{arguments}{_END}"


def system_section(tools: Sequence[dict]) -> str:
    """The system-prompt section that offers ``tools`` ([{"name", "description", "parameters"}])."""
    lines = [json.dumps({"type": "function", "function": {
        "name": t["name"], "description": t.get("description") or "",
        "parameters": t.get("parameters") or ANY_OBJECT}}, ensure_ascii=False) for t in tools]
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            + "\n".join(lines) + "\n</tools>\n\nFor each function call, return a json object with "
            "function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def render(messages: Sequence[dict], tools: Optional[Sequence[dict]] = None) -> list[dict]:
    """Template messages ({"role", "content"}: system, user, assistant) of an
    OpenAI-style conversation: ``developer`` is a system message; an
    assistant's ``tool_calls`` ([{"id", "name", "arguments"}]) follow its
    content as call blocks; consecutive ``tool`` messages make one user turn of
    ``<tool_response>`` blocks.  With ``tools``, their section ends the first
    system message (or is one, first)."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "developer":
            role = "system"
        if role == "assistant" and m.get("tool_calls"):
            blocks = "\n".join(call_text(c["name"], c["arguments"]) for c in m["tool_calls"])
            content = f"{content}\n{blocks}" if content else blocks
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool"):
                out[-1]["content"] += "\n" + block
                continue
            out.append({"role": "user", "content": block, "tool": True})
            continue
        out.append({"role": role, "content": content})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        section = system_section(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _lark_string(s: str) -> str:
    return json.dumps(s)                             # a JSON string literal is a Lark string literal


def _schema(parameters: Optional[dict]) -> str:
    """A tool's schema for %json: compact JSON unless the schema says otherwise, and
    objects closed (`closed`)."""
    return json.dumps(compact_schema(closed(parameters or ANY_OBJECT)))


_SUBSCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties")


def closed(schema):
    """``schema`` with every object that lists its ``properties`` and says nothing of
    others given ``additionalProperties: false``: a call's arguments hold the
    properties its tool declares, and a model cannot wander off into invented keys
    until the token limit cuts it (JSON Schema's default would allow them)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    for k in _SUBSCHEMAS:
        if k in out:
            out[k] = closed(out[k])
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [closed(x) for x in out[k]]
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed(x) for name, x in out[k].items()}
    return out


def calls_grammar(tools: Sequence[dict], *, only: Optional[str] = None, parallel: bool = True,
                  text_rule: Optional[str] = None, start: str = "start") -> str:
    """Lark grammar: one call (several, newline-separated, with ``parallel``)
    of ``tools`` (of the tool named ``only``), arguments following each tool's
    schema.  ``text_rule``: the answer may instead be text matching that Lark
    rule body (`symphony.lip.grammar.format_rule` of a format)."""
    chosen = [t for t in tools if only is None or t["name"] == only]
    rules, alts = [], []
    for i, t in enumerate(chosen):
        alts.append(f"call_{i}")
        rules.append(f"call_{i}: {_lark_string(_HEAD + json.dumps(t['name']) + _ARGS)} args_{i} "
                     f"{_lark_string(_END)}")
        rules.append(f"args_{i}: %json {_schema(t.get('parameters'))}")
    calls = "call" if not parallel else 'call ("\\n" call)*'
    top = f"{start}: calls" if text_rule is None else f"{start}: text | calls\ntext: {text_rule}"
    return "\n".join([top, f"calls: {calls}", f"call: {' | '.join(alts)}", *rules]) + "\n"


class CallParser:
    """The text of call blocks in (as it streams), call events out.

    ``feed(text) -> [event]``: ``{"call": k, "name": NAME, "arguments": first piece}``
    when call k's name is known, then ``{"call": k, "arguments": piece}``; the
    pieces of call k concatenate to its arguments' JSON text.  ``finish()``
    flushes a call cut short.  ``calls``: how many calls started; ``ended``: how
    many were written whole (their block closed)."""

    def __init__(self):
        self.buf, self.calls, self.args = "", 0, None    # args: the StopChecker of the open call
        self.ended = 0
        self.text = ""                                     # the open call's arguments so far

    def feed(self, text: str) -> list[dict]:
        events = []
        self.buf += text
        while True:
            if self.args is None:                          # between calls: wait for a whole head
                s = self.buf.lstrip()
                if not (s.startswith(_HEAD) or _HEAD.startswith(s)):
                    self.buf = ""                          # not call text (the grammar rules it out)
                    break
                j = s.find(_ARGS, len(_HEAD))
                if j < 0:
                    break
                events.append({"call": self.calls, "name": json.loads(s[len(_HEAD):j]), "arguments": ""})
                self.buf, self.args, self.text = s[j + len(_ARGS):], StopChecker([_END]), ""
                self.calls += 1
            if not self.buf:
                break
            piece, stop = self.args.push(self.buf)
            self.buf = ""
            if piece:
                self.text += piece
                if events and events[-1]["call"] == self.calls - 1:
                    events[-1]["arguments"] += piece
                else:
                    events.append({"call": self.calls - 1, "arguments": piece})
            if not stop:
                break
            self.buf, self.args = self.args.rest[len(_END):], None
            self.ended += 1
        return events

    def finish(self) -> list[dict]:
        """The end of the text: a call cut short gets the closing brace it may
        have written (held back as the possible start of the block's end)."""
        if self.args is None:
            return []
        held, self.args = self.args.held, None
        if held.startswith("}") and not _parses(self.text) and _parses(self.text + "}"):
            return [{"call": self.calls - 1, "arguments": "}"}]
        return []


class CallGuard:
    """Call events in (`CallParser`'s), the ones to send out, so that an answer of
    calls never ends in a runaway: the first call streams as it comes; each later
    call is held until it is written whole, then sent, or dropped when it repeats
    an earlier call of the answer (same name and arguments: ``repeated`` is then
    its index, and the answer ends before it; a small model otherwise tends to
    write the same call again and again until the token limit).  A call still
    held at the end was cut by the token limit: `finish` drops it (``cut``) unless
    its arguments are whole, so the answer is the calls written whole."""

    def __init__(self):
        self.calls: list = []          # [name, arguments] per call
        self.held: list = []           # the events of the call being written, after the first
        self.repeated: Optional[int] = None
        self.cut = False

    def push(self, events: list, ended: int) -> list:
        """The events to send of ``events``; ``ended``: the calls written whole so far."""
        out = []
        for e in events:
            k = e["call"]
            if self.repeated is not None and k >= self.repeated:
                continue
            if "name" in e:
                if self.held:                  # the call before was written whole (the parser began this one)
                    out += self._settle(k - 1)
                    if self.repeated is not None:
                        continue
                self.calls.append([e["name"], ""])
            self.calls[k][1] += e["arguments"]
            (out if k == 0 else self.held).append(e)
        if self.held and ended >= len(self.calls):
            out += self._settle(len(self.calls) - 1)
        return out

    def finish(self) -> list:
        """The end of the answer: the events of a call still held whose arguments are
        whole JSON (only its closing tag was cut); one cut shorter is dropped (``cut``)."""
        if not self.held:
            return []
        if _parses(self.calls[-1][1]):
            return self._settle(len(self.calls) - 1)
        self.held, self.cut = [], True
        return []

    @property
    def sent(self) -> int:
        """How many calls were (or will be) sent whole or, the first, as it came."""
        n = len(self.calls) - (1 if self.held or self.cut else 0)
        return n if self.repeated is None else min(n, self.repeated)

    def _settle(self, k: int) -> list:
        """Call ``k`` was written whole: its held events merged into one, or nothing if it
        repeats one before it."""
        held, self.held = self.held, []
        if self.calls[k] in self.calls[:k]:
            self.repeated = k
            return []
        return [dict(held[0], arguments="".join(e["arguments"] for e in held))]


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False
