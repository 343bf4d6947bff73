"""The LIP library: what an LLM Inference Program imports.

    from symphony.lip import kv, pred, tokenize, detokenize, send, EOS

    def main(question):
        f = kv.create()                                  # anonymous KV file
        t = tokenize(question)
        while (t := [pred(f, t).argmax()]) != [EOS]:
            send(detokenize(t))

Every function here is a system call to the kernel through the LIP's shared
memory (except `tokenize`/`detokenize`, which run locally).  Errors raise the
typed exceptions of `symphony.lip.errors`.  See the README, "Writing a LIP".
"""
from __future__ import annotations

from symphony.tokenizer import StreamDecoder, TokenizerError  # noqa: F401

from .errors import *  # noqa: F401,F403
from . import runtime as _runtime
from .runtime import (KVFile, capabilities, detokenize, http, info, kv, list_dir,  # noqa: F401
                      mask_words, pred, read_file, recv, send, tokenize, tokenizer, vocab_size)

__all__ = ["kv", "KVFile", "pred", "tokenize", "detokenize", "send", "recv", "EOS", "http",
           "read_file", "list_dir", "info", "tokenizer", "capabilities", "mask_words", "vocab_size",
           "StreamDecoder", "TokenizerError"]


def __getattr__(name: str):
    """Values known only once the LIP is attached (``EOS``) are read from the
    runtime at each access, never copied at import: the zygote imports this
    package before any LIP exists."""
    if name in _runtime.ATTACHED:
        return getattr(_runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
