"""Tools, tool choices, output formats and logit biases: OpenAI's (and vLLM's) shapes to the serving program's.

Chat completions and responses spell the same ideas differently
(``{"type": "function", "function": {"name"}}`` vs ``{"type": "function",
"name"}``); both become the serve contract's ``tools`` /
``tool_choice`` / ``response_format`` here, checked: a named or allowed tool
that is not among ``tools``, a ``json_schema`` format without a schema, a
tool schema that is not an object schema: 400.  `answer_format` also takes
vLLM's ``structured_outputs`` (``choice``, ``regex``, ``json``, ``grammar``) and
its older ``guided_*`` names; `logit_bias` turns OpenAI's ``{"token id": bias}``
into the contract's pairs.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from symphony.ipc.abi import MAX_LOGIT_BIAS

from .errors import ApiError


def tool_list(tools: list[dict]) -> list[dict]:
    """[{"name", "description", "parameters"}] with unique names."""
    seen = set()
    for i, t in enumerate(tools):
        if t["name"] in seen:
            raise ApiError(400, f"two tools are named {t['name']!r}", param=f"tools[{i}]")
        seen.add(t["name"])
        p = t.get("parameters")
        if p is not None and not (isinstance(p, dict) and p.get("type", "object") == "object"):
            raise ApiError(400, f"tool {t['name']!r}: parameters must be a JSON schema of an object",
                           param=f"tools[{i}].parameters")
    return tools


def _named(choice: dict, flat: bool) -> Optional[str]:
    if flat:
        return choice.get("name")
    f = choice.get("function")
    return f.get("name") if isinstance(f, dict) else None


def tool_choice(choice: Any, tools: list[dict], *, flat: bool) -> tuple[str | dict, list[dict]]:
    """(the contract's tool_choice, the tools offered) from OpenAI's
    ``tool_choice``; ``flat``: the Responses spelling."""
    names = {t["name"] for t in tools}
    if choice is None:
        return ("auto" if tools else "none"), tools
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ApiError(400, f"tool_choice must be 'auto', 'none', 'required' or an object, got {choice!r}",
                           param="tool_choice")
        if choice == "required" and not tools:
            raise ApiError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return choice, tools
    if not isinstance(choice, dict):
        raise ApiError(400, "tool_choice must be a string or an object", param="tool_choice")
    kind = choice.get("type")
    if kind == "function":
        name = _named(choice, flat)
        if name not in names:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                           param="tool_choice")
        return {"name": name}, tools
    if kind == "allowed_tools":
        spec = choice if flat else choice.get("allowed_tools")
        if not isinstance(spec, dict) or not isinstance(spec.get("tools"), list):
            raise ApiError(400, "tool_choice allowed_tools needs a list of tools", param="tool_choice")
        mode = spec.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise ApiError(400, "allowed_tools mode must be 'auto' or 'required'", param="tool_choice")
        allowed = []
        for t in spec["tools"]:
            name = _named(t, flat) if isinstance(t, dict) else None
            if name not in names:
                raise ApiError(400, f"allowed_tools names {name!r}, which is not among the tools",
                               param="tool_choice")
            allowed.append(name)
        return mode, [t for t in tools if t["name"] in allowed]
    raise ApiError(400, f"tool_choice of type {kind!r} is not supported (function tools only)",
                   param="tool_choice")


def output_format(kind: str, schema: Optional[dict], where: str) -> Optional[dict]:
    """The contract's response_format from a format's type and schema."""
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if not isinstance(schema, dict):
        raise ApiError(400, "a json_schema format needs a 'schema' object", param=where)
    return {"type": "json_schema", "schema": schema}



def logit_bias(bias: Optional[dict]) -> list:
    """OpenAI's ``logit_bias`` (token ids as decimal strings -> a bias in [-100, 100],
    the range checked by the request's type) as [[token id, bias], ...]; 400 for a key
    that is no token id or for more than MAX_LOGIT_BIAS entries.  Ids beyond the
    vocabulary are refused by the serving program, which knows it."""
    if not bias:
        return []
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}",
                       param="logit_bias")
    out = []
    for k, v in bias.items():
        if not (k.isascii() and k.isdigit()) or len(k) > 9:
            raise ApiError(400, f"logit_bias keys must be token ids (decimal integers >= 0), got {k[:32]!r}",
                           param="logit_bias")
        out.append([int(k), v])
    return out


def answer_format(r) -> Optional[dict]:
    """The contract's response_format of a chat or completion request: OpenAI's
    ``response_format``, or one of vLLM's ``structured_outputs`` fields or ``guided_*``
    parameters (two of them at once: 400)."""
    given = []
    fmt = r.response_format
    if fmt is not None and fmt.type != "text":
        given.append(("response_format", output_format(fmt.type, fmt.json_schema.schema if fmt.json_schema else None,
                                                       "response_format.json_schema")))
    so = r.structured_outputs
    if so is not None:
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(so, name) is not None:
                raise ApiError(400, f"structured_outputs.{name} is not supported", param=f"structured_outputs.{name}")
        given += _structured("structured_outputs.", so.choice, so.regex, so.json, so.grammar)
        if so.json_object:
            given.append(("structured_outputs.json_object", {"type": "json_object"}))
    given += _structured("guided_", r.guided_choice, r.guided_regex, r.guided_json, r.guided_grammar)
    if len(given) > 1:
        raise ApiError(400, f"give one way to constrain the answer, not {' and '.join(n for n, _ in given)}",
                       param=given[1][0])
    return given[0][1] if given else None


def _structured(prefix: str, choice, regex, schema, grammar) -> list:
    out = []
    if choice is not None:
        out.append((prefix + "choice", {"type": "choice", "choices": choice}))
    if regex is not None:
        out.append((prefix + "regex", {"type": "regex", "pattern": regex}))
    if schema is not None:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise ApiError(400, f"{prefix}json must be a JSON schema (an object, or its JSON text)",
                               param=prefix + "json") from None
        if not isinstance(schema, dict):
            raise ApiError(400, f"{prefix}json must be a JSON schema object", param=prefix + "json")
        out.append((prefix + "json", {"type": "json_schema", "schema": schema}))
    if grammar is not None:
        out.append((prefix + "grammar", {"type": "grammar", "grammar": grammar}))
    return out
