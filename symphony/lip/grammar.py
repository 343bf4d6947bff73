"""Grammars for constrained decoding with llguidance, on the LIP's tokenizer.

    m = matcher(json_schema({"type": "object"}))     # GrammarRejected: llguidance's message
    Decoder(f, matcher=m.deep_copy())                 # symphony.lip.decoding

JSON schemas compile to compact JSON (no optional whitespace: a small model
given free whitespace wanders off) unless the schema's ``x-guidance`` says
otherwise.

The serving contract's answer formats (``symphony.ipc.serving``: JSON object,
JSON schema, regex, a choice of strings, a Lark grammar) become a grammar with
`format_grammar`, or the right-hand side of a Lark rule with `format_rule` (to
sit beside tool calls: ``start: text | calls``).
"""
from __future__ import annotations

import functools
import json

import llguidance

from . import runtime

__all__ = ["GrammarRejected", "format_grammar", "format_rule", "json_schema", "lark", "ll_tokenizer", "matcher",
           "preload", "token_bytes"]

_llt = None     # llguidance's view of the vocabulary: built by `preload` or at first use


class GrammarRejected(ValueError):
    """llguidance refused a grammar or schema (the message is llguidance's)."""


def ll_tokenizer() -> "llguidance.LLTokenizer":
    """The llguidance view of the model's vocabulary (the zygote builds it once for all LIPs)."""
    if _llt is None:
        preload(runtime.tokenizer())
    return _llt


def preload(tok) -> None:
    """Build the llguidance view of ``tok`` (a `symphony.tokenizer.Tokenizer`) now: the zygote
    does, once, before it forks the LIPs that will use it."""
    global _llt
    _llt = llguidance.LLTokenizer(tok.hf_json(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_ids))


def json_schema(schema) -> str:
    """The grammar of JSON text that validates against ``schema`` (a dict or JSON text)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except ValueError as e:                                   # not a JSON object
        raise GrammarRejected(str(e)) from None


def lark(text: str) -> str:
    """A Lark grammar (llguidance's dialect: ``%json {schema}`` embeds a JSON schema)."""
    return llguidance.LLMatcher.grammar_from_lark(text)


def compact_schema(schema: dict) -> dict:
    """``schema`` with compact JSON asked for, unless its ``x-guidance`` says otherwise."""
    return dict(schema, **{"x-guidance": {"whitespace_flexible": False, **(schema.get("x-guidance") or {})}})


def format_grammar(fmt) -> str:
    """The grammar of an answer in format ``fmt`` (a ``symphony.ipc.serving`` format
    struct; text formats are None, not passed here)."""
    kind = type(fmt).__name__
    if kind == "GrammarFormat":
        return lark(fmt.grammar)
    if kind == "RegexFormat":
        return _regex(fmt.pattern)
    if kind in ("JsonObjectFormat", "JsonSchemaFormat"):
        return json_schema(fmt.schema if kind == "JsonSchemaFormat" else {"type": "object"})
    return lark("start: " + format_rule(fmt))


def format_rule(fmt) -> str:
    """The right-hand side of a Lark rule that matches an answer in format ``fmt``
    (GrammarRejected for a grammar, which is a whole grammar of its own)."""
    kind = type(fmt).__name__
    if kind == "JsonObjectFormat":
        return "%json " + json.dumps(compact_schema({"type": "object"}))
    if kind == "JsonSchemaFormat":
        return "%json " + json.dumps(compact_schema(fmt.schema))
    if kind == "ChoiceFormat":
        return " | ".join(json.dumps(c) for c in fmt.choices)     # a JSON string literal is a Lark string
    if kind == "RegexFormat":
        g = json.loads(_regex(fmt.pattern))["grammars"][0]["lark_grammar"]
        return g.split(":", 1)[1].strip()                          # llguidance's own escaping of the pattern
    raise GrammarRejected(f"a {kind} cannot be combined with tool calls")


def _regex(pattern: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_regex(pattern)
    except ValueError as e:
        raise GrammarRejected(str(e)) from None


def matcher(grammar: str) -> "llguidance.LLMatcher":
    """A matcher at the start of ``grammar``; GrammarRejected if llguidance refuses it."""
    try:
        m = llguidance.LLMatcher(ll_tokenizer(), grammar, log_level=0)
    except ValueError as e:
        raise GrammarRejected(str(e)) from None
    if m.is_error():
        raise GrammarRejected(m.get_error())
    return m


@functools.lru_cache(maxsize=None)
def token_bytes(token: int) -> bytes:
    """The bytes a token stands for (a special token: its text)."""
    return ll_tokenizer().decode_bytes([token])
