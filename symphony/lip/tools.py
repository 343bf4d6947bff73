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

from .helpers import StopChecker

__all__ = ["MARKER", "NAME", "CallParser", "call_text", "calls_grammar", "render", "system_section"]

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
    """A tool's schema for %json: compact JSON unless the schema says otherwise."""
    schema = dict(parameters or ANY_OBJECT)
    schema["x-guidance"] = {"whitespace_flexible": False, **(schema.get("x-guidance") or {})}
    return json.dumps(schema)


def calls_grammar(tools: Sequence[dict], *, only: Optional[str] = None, parallel: bool = True,
                  text_schema: Optional[dict] = None, start: str = "start") -> str:
    """Lark grammar: one call (several, newline-separated, with ``parallel``)
    of ``tools`` (of the tool named ``only``), arguments following each tool's
    schema.  ``text_schema``: the answer may instead be JSON text of that schema."""
    chosen = [t for t in tools if only is None or t["name"] == only]
    rules, alts = [], []
    for i, t in enumerate(chosen):
        alts.append(f"call_{i}")
        rules.append(f"call_{i}: {_lark_string(_HEAD + json.dumps(t['name']) + _ARGS)} args_{i} "
                     f"{_lark_string(_END)}")
        rules.append(f"args_{i}: %json {_schema(t.get('parameters'))}")
    calls = "call" if not parallel else 'call ("\\n" call)*'
    top = f"{start}: calls" if text_schema is None else f"{start}: text | calls\ntext: %json {_schema(text_schema)}"
    return "\n".join([top, f"calls: {calls}", f"call: {' | '.join(alts)}", *rules]) + "\n"


class CallParser:
    """The text of call blocks in (as it streams), call events out.

    ``feed(text) -> [event]``: ``{"call": k, "name": NAME, "arguments": first piece}``
    when call k's name is known, then ``{"call": k, "arguments": piece}``; the
    pieces of call k concatenate to its arguments' JSON text.  ``finish()``
    flushes a call cut short.  ``calls``: how many calls started."""

    def __init__(self):
        self.buf, self.calls, self.args = "", 0, None    # args: the StopChecker of the open call
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


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False
