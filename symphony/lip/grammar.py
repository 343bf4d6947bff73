"""Grammars for constrained decoding with llguidance, on the LIP's tokenizer.

    m = matcher(json_schema({"type": "object"}))     # GrammarRejected: llguidance's message
    Decoder(f, matcher=m.deep_copy())                 # symphony.lip.decoding

JSON schemas compile to compact JSON (no optional whitespace: a small model
given free whitespace wanders off) unless the schema's ``x-guidance`` says
otherwise.
"""
from __future__ import annotations

import functools

import llguidance

from . import runtime

__all__ = ["GrammarRejected", "json_schema", "lark", "ll_tokenizer", "matcher", "preload", "token_bytes"]

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
