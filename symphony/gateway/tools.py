"""Tools, tool choices and output formats: OpenAI's shapes to the serving program's.

Chat completions and responses spell the same ideas differently
(``{"type": "function", "function": {"name"}}`` vs ``{"type": "function",
"name"}``); both become the serve contract's ``tools`` /
``tool_choice`` / ``response_format`` here, checked: a named or allowed tool
that is not among ``tools``, a ``json_schema`` format without a schema, a
tool schema that is not an object schema: 400.
"""
from __future__ import annotations

from typing import Any, Optional

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
