"""Tokenizer built from a model file's own metadata with the `tokenizers` package.

GGUF files carry the vocabulary, the BPE merges, the token types, BOS/EOS ids
and a Jinja chat template; Hugging Face directories carry ``tokenizer.json``
and ``tokenizer_config.json``.  Both become the same `Tokenizer`, which can be
serialised to one JSON string (`to_json` / `from_json`) so that a LIP worker
can rebuild it without reading the model file.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import orjson
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

log = logging.getLogger("symphony.tokenizer")

# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class TokenizerError(ValueError):
    """Bad tokenizer data or a bad argument to a tokenizer call."""


class Tokenizer:
    """Text <-> token ids, special tokens, and the model's chat template."""

    def __init__(self, hf: _HFTokenizer, *, bos_id: Optional[int], eos_ids: Sequence[int],
                 chat_template: Optional[str], add_bos: bool = False):
        self._tok = hf
        self.bos_id = bos_id
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self._template_fn: Optional[Callable[..., str]] = None
        self._special: Optional[frozenset] = None

    # ------------------------------------------------------------------ public API
    def encode(self, text: str, *, add_bos: Optional[bool] = None) -> list[int]:
        """Token ids of ``text``; special-token strings in it map to their ids."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token id {bad[0]} is out of range [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    @property
    def special_ids(self) -> frozenset:
        """Ids of the special tokens (a chat template's markers, EOS, ...)."""
        if self._special is None:
            self._special = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        return self._special

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> Optional[str]:
        return self._tok.id_to_token(int(i))

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's template."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise TokenizerError(f"a chat message must be {{'role': str, 'content': str}}, got {m!r}")
        if self._template_fn is None:
            self._template_fn = _compile_template(self.chat_template)
        tok = lambda i: (self.id_to_token(i) or "") if i is not None else ""
        return self._template_fn(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                 bos_token=tok(self.bos_id), eos_token=tok(self.eos_id), **extra)

    def encode_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt),
                           add_bos=False)

    def hf_json(self) -> str:
        """The vocabulary and its rules as Hugging Face ``tokenizers`` JSON (what llguidance reads)."""
        return self._tok.to_str()

    def to_json(self) -> str:
        return orjson.dumps({"tokenizer": self.hf_json(), "bos_id": self.bos_id,
                             "eos_ids": list(self.eos_ids), "chat_template": self.chat_template,
                             "add_bos": self.add_bos}).decode()

    @classmethod
    def from_json(cls, s: str) -> "Tokenizer":
        d = orjson.loads(s)
        return cls(_HFTokenizer.from_str(d["tokenizer"]), bos_id=d["bos_id"], eos_ids=d["eos_ids"],
                   chat_template=d["chat_template"], add_bos=d["add_bos"])

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_gguf_fields(cls, meta: Callable[..., Any], where: Path) -> "Tokenizer":
        """Build from GGUF ``tokenizer.ggml.*`` metadata (``meta(key, default)``)."""
        model = meta("tokenizer.ggml.model")
        tokens = meta("tokenizer.ggml.tokens")
        if model is None or tokens is None:
            raise TokenizerError(f"{where}: the GGUF file has no tokenizer (tokenizer.ggml.*)")
        types = list(meta("tokenizer.ggml.token_type", [_NORMAL] * len(tokens)))
        if model == "gpt2":
            hf = _bpe_from_gguf(tokens, meta("tokenizer.ggml.merges", []), meta("tokenizer.ggml.pre", "default"))
        elif model == "llama":
            hf = _spm_from_gguf(tokens, meta("tokenizer.ggml.scores"), types,
                                bool(meta("tokenizer.ggml.add_space_prefix", True)))
        else:
            raise TokenizerError(f"{where}: unsupported tokenizer model {model!r} (supported: gpt2, llama)")
        specials = [AddedToken(t, special=True, normalized=False)
                    for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)]
        hf.add_special_tokens(specials)
        eos = [meta(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id")]
        bos = meta("tokenizer.ggml.bos_token_id")
        return cls(hf, bos_id=None if bos is None else int(bos), eos_ids=[int(e) for e in eos if e is not None],
                   chat_template=meta("tokenizer.chat_template"),
                   add_bos=bool(meta("tokenizer.ggml.add_bos_token", model == "llama")))

    @classmethod
    def from_hf_dir(cls, path: Path) -> "Tokenizer":
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"{path}: tokenizer.json is missing")
        try:
            hf = _HFTokenizer.from_file(str(tj))
        except Exception as e:
            raise TokenizerError(f"{tj}: cannot be read: {e}") from None
        conf = {}
        if (path / "tokenizer_config.json").is_file():
            conf = json.loads((path / "tokenizer_config.json").read_text())
        gen = {}
        if (path / "generation_config.json").is_file():
            gen = json.loads((path / "generation_config.json").read_text())

        def tok_id(v):
            if isinstance(v, dict):
                v = v.get("content")
            return hf.token_to_id(v) if isinstance(v, str) else None
        eos = gen.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        if tok_id(conf.get("eos_token")) is not None:
            eos_ids = [tok_id(conf["eos_token"])] + [e for e in eos_ids if e != tok_id(conf["eos_token"])]
        template = conf.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(hf, bos_id=tok_id(conf.get("bos_token")), eos_ids=eos_ids, chat_template=template,
                   add_bos=bool(conf.get("add_bos_token", False)))


# --------------------------------------------------------------------------- helpers

def _bpe_from_gguf(tokens: list[str], merges: list[str], pre: str) -> _HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise TokenizerError(f"malformed BPE merge {m!r}")
        pairs.append((a, b))
    ignore_merges = pre in ("llama-bpe", "llama3")
    hf = _HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=ignore_merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama-bpe", "llama3"):
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), byte_level])
    elif pre == "qwen2":
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"), byte_level])
    elif pre in ("smollm", "starcoder", "refact"):
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        if pre not in ("gpt2", "default"):
            log.warning("unknown GGUF pre-tokenizer %r: using GPT-2 byte-level rules", pre)
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    return hf


def _spm_from_gguf(tokens: list[str], scores: Optional[list[float]], types: list[int],
                   add_space_prefix: bool) -> _HFTokenizer:
    """SentencePiece-BPE vocabulary (Llama 2 style): merges are recovered from
    the scores (a pair merges with the rank of the token it makes)."""
    if scores is None:
        raise TokenizerError("SentencePiece GGUF tokenizer without tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t: s for t, s, ty in zip(tokens, scores, types) if ty in (_NORMAL, _USER_DEFINED)}
    rank = {t: r for r, (t, _) in enumerate(sorted(normal.items(), key=lambda kv: -kv[1]))}
    merges = []
    for t in rank:
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                merges.append((rank[t], vocab[a], vocab[b], a, b))
    merges.sort()
    unk = next((t for t, ty in zip(tokens, types) if ty == _UNKNOWN), None)
    hf = _HFTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges],
                                 unk_token=unk, fuse_unk=True, byte_fallback=True))
    norm = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("\u2581"))
    hf.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(dec)
    return hf


def _compile_template(source: str) -> Callable[..., str]:
    """Compile a chat template in a sandbox (templates come from model files)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise TokenizerError(f"chat template: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    try:
        tpl = env.from_string(source)
    except TemplateError as e:
        raise TokenizerError(f"the model's chat template does not compile: {e}") from None
    return tpl.render


class StreamDecoder:
    """Incremental detokenization for streaming: feed token ids, get the new
    text.  Text is held back while it ends in an incomplete UTF-8 sequence, and
    only a short window of tokens is re-decoded each step."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True):
        self.tok, self.skip = tokenizer, skip_special
        self.ids: list[int] = []
        self.prefix_start = 0      # window start
        self.emitted_upto = 0      # tokens[prefix_start:emitted_upto] are already printed

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prev = self.tok.decode(self.ids[self.prefix_start:self.emitted_upto], skip_special=self.skip)
        text = self.tok.decode(self.ids[self.prefix_start:], skip_special=self.skip)
        if text.endswith("\ufffd") or len(text) <= len(prev):
            return ""
        self.prefix_start, self.emitted_upto = self.emitted_upto, len(self.ids)
        return text[len(prev):]

    def flush(self) -> str:
        prev = self.tok.decode(self.ids[self.prefix_start:self.emitted_upto], skip_special=self.skip)
        text = self.tok.decode(self.ids[self.prefix_start:], skip_special=self.skip)
        self.prefix_start = self.emitted_upto = len(self.ids)
        return text[len(prev):]
