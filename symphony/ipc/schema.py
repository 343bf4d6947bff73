"""Each system call's request body, declared once as a type, for both sides.

The kernel decodes a body with its op's type (`decode`: JSON -> a typed, validated
`msgspec.Struct`, the only place a body is checked for shape); the LIP library
builds one with the same type (`build`: keyword arguments -> a validated Struct ->
JSON).  So a mistake is refused with the same message on either side::

    LIP   pred(f, toks, output="sample", top_p=0)   ->  build(PRED, ...)  -> SchemaError
    kernel   (a hostile LIP skips build)            ->  decode(PRED, raw) -> SchemaError

A body is a JSON object with only the fields declared here (an unknown field is
refused); strings, ints and lists are checked for type and for the bounds that
need no kernel state (`abi` limits).  What depends on the kernel's state (the
vocabulary size, the arena's size, whether a handle or path exists, the
capability policy) stays in the handler.  Messages name the field:
``"n_tokens must be an int in [1, 8192], got 0"``.

msgspec (maintained, C-fast, strict: no str->int or bool->int coercion) does
the decoding; a body that is not JSON at all raises `Undecodable` (the kernel
counts a strike), one that does not fit the type raises `SchemaError`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

import msgspec
import msgspec.inspect
from msgspec import Meta

from . import abi

__all__ = ["SchemaError", "Undecodable", "UnknownOp", "REQUESTS", "decode", "build", "encode", "describe",
           "Empty", "Pred", "KvCreate", "KvOpen", "KvHandle", "KvPath", "KvMkdir", "KvFork", "KvTruncate",
           "KvExtract", "KvMerge", "KvStat", "KvAdvise", "KvRename", "KvLookup", "KvPublish", "Send",
           "WriteStream", "Fetch", "CapHttp", "CapReadFile", "CapListDir"]


class SchemaError(ValueError):
    """A body that does not fit its op's type; ``field`` names the culprit ('' for the body)."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


class Undecodable(SchemaError):
    """A body that is not JSON at all."""


class UnknownOp(SchemaError):
    """An op number the ABI does not have."""


# ---------------------------------------------------------------- field types
def _must(tp, text: str, **bounds):
    """``tp`` with bounds, and the words an error uses for it ("n must be <text>")."""
    return Annotated[tp, Meta(**bounds, extra={"must": text})]


Handle = _must(int, "a KV handle (an int)")           # which handles exist: KVFS
Path = _must(str, "a string path")
OptPath = Optional[Path]
_ModeBits = _must(int, "a permission mode (an int in [0, 0o7777]) or null", ge=0, le=0o7777)
Mode = Optional[_ModeBits]
Number = _must(float, "a number")
_TEMPERATURE = f"0 (greedy) or a number in [{abi.MIN_TEMPERATURE}, {abi.MAX_TEMPERATURE}]"
Temperature = _must(float, _TEMPERATURE, ge=0, le=abi.MAX_TEMPERATURE)
TopP = _must(float, "a number in (0, 1]", gt=0, le=1)
MinP = _must(float, "a number in [0, 1] (0: off)", ge=0, le=1)
Str = _must(str, "a string")
Flag = _must(bool, "true or false")
NTokens = _must(int, f"an int in [1, {abi.MAX_TOKENS_PER_CALL}]", ge=1, le=abi.MAX_TOKENS_PER_CALL)
_Positions = _must(list[Annotated[int, Meta(ge=0)]], "a list of ints >= 0, or null",
                   max_length=abi.MAX_TOKENS_PER_CALL)
Positions = Optional[_Positions]
Output = _must(Literal[abi.OUTPUTS], f"one of {abi.OUTPUTS}")
TopKCount = _must(int, f"an int in [1, {abi.MAX_TOP_K}]", ge=1, le=abi.MAX_TOP_K)
_SampleTopK = _must(int, "an int >= 0 (0: no top-k)", ge=0, le=1 << 31)
SampleTopK = Optional[_SampleTopK]
_Seed = _must(int, "an int or null")
Seed = Optional[_Seed]
MaskWords = _must(int, f"an int in [0, {abi.MAX_MASK_WORDS}]", ge=0, le=abi.MAX_MASK_WORDS)
_BIAS = abi.MAX_LOGIT_BIAS_VALUE
_LogitBias = _must(list[tuple[Annotated[int, Meta(ge=0)], Annotated[float, Meta(ge=-_BIAS, le=_BIAS)]]],
                   f"a list of at most {abi.MAX_LOGIT_BIAS} [token id >= 0, bias in [{-_BIAS}, {_BIAS}]] "
                   f"pairs, or null", max_length=abi.MAX_LOGIT_BIAS)
LogitBias = Optional[_LogitBias]
Length = _must(int, "an int >= 0", ge=0)
Ranges = _must(list[tuple[int, int]], f"a non-empty list of at most {abi.MAX_LIST_ITEMS} [start, end) pairs",
               min_length=1, max_length=abi.MAX_LIST_ITEMS)
Handles = _must(list[int], f"a non-empty list of at most {abi.MAX_LIST_ITEMS} KV handles",
                min_length=1, max_length=abi.MAX_LIST_ITEMS)
_Seconds = _must(float, "a number of seconds or null")
Seconds = Optional[_Seconds]
AnyJson = _must(Any, "any JSON value")
Stream = _must(Literal["stdout", "stderr"], "'stdout' or 'stderr'")
ReplyId = _must(int, f"an int in [1, {abi.MAX_ID}]", ge=1, le=abi.MAX_ID)
Offset = _must(int, f"an int in [0, {abi.MAX_ID}]", ge=0, le=abi.MAX_ID)
BlockSize = _must(int, f"an int in [1, {abi.MAX_BLOCK}] (a multiple of the page size)", ge=1, le=abi.MAX_BLOCK)
NKeys = _must(int, f"an int in [0, {abi.MAX_KEYS_PER_CALL}]", ge=0, le=abi.MAX_KEYS_PER_CALL)
_Limit = _must(int, "an int >= 0 (blocks), or null", ge=0)
Limit = Optional[_Limit]
Wait = _must(float, f"a number of seconds in [0, {abi.MAX_LOOKUP_WAIT_S:g}]", ge=0, le=abi.MAX_LOOKUP_WAIT_S)
Trust = _must(list[Annotated[str, Meta(min_length=1, max_length=32)]],
              f"a list of at most {abi.MAX_TRUST} user names, or null", max_length=abi.MAX_TRUST)
_Ttl = _must(float, "a number of seconds >= 0, or null", ge=0)
Ttl = Optional[_Ttl]
_Headers = _must(dict[str, Any], "an object of header names to values, or null")
Headers = Optional[_Headers]


class _Body(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """A request body: a JSON object of exactly these fields."""


class Empty(_Body):
    """NOP, INFO, RECV: no arguments."""


class Pred(_Body):
    """PRED: append ``n_tokens`` tokens (the call's int32 array, then ``n_mask_words``
    uint32 mask words) to KV file ``kv`` and run the model.  ``logit_bias``: (token
    id, bias) pairs added to the logits before the mask and any output (the kernel
    checks the ids against the vocabulary and refuses a repeated id)."""
    kv: Handle
    n_tokens: NTokens
    positions: Positions = None
    all_logits: Flag = False
    output: Output = "logits"
    k: TopKCount = 20
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: SampleTopK = 0
    seed: Seed = None
    min_p: MinP = 0.0
    n_mask_words: MaskWords = 0
    logit_bias: LogitBias = None

    def __post_init__(self):
        if self.positions is not None and len(self.positions) != self.n_tokens:
            raise ValueError("positions and tokens differ in length")
        if 0 < self.temperature < abi.MIN_TEMPERATURE:      # the gap the type's bounds leave
            raise ValueError(f"temperature must be {_TEMPERATURE}, got {self.temperature!r}")

    @property
    def sampling(self) -> tuple:
        """(temperature, top_p, top_k, seed, min_p), top_k 0 for none."""
        return self.temperature, self.top_p, self.top_k or 0, self.seed, self.min_p


class KvCreate(_Body, kw_only=True):
    """KV_CREATE: a new file, anonymous unless ``path``, with ``mode`` (None: KVFS's
    default).  The calls that make a new file (fork, extract, merge) take these too."""
    path: OptPath = None
    mode: Mode = None


class KvOpen(_Body):
    """KV_OPEN: open a named file, ``mode`` 'r' or 'rw' (KVFS checks the value)."""
    path: Path
    mode: Str = "r"


class KvHandle(_Body):
    """KV_CLOSE, KV_SYNC: one handle."""
    kv: Handle


class KvPath(_Body):
    """KV_REMOVE, KV_RMDIR, KV_LIST: one path."""
    path: Path


class KvMkdir(_Body):
    """KV_MKDIR: a new directory."""
    path: Path
    mode: Mode = None


class KvFork(KvCreate):
    """KV_FORK: a copy-on-write clone of ``kv``."""
    kv: Handle


class KvTruncate(_Body):
    """KV_TRUNCATE: keep the first ``n`` tokens (KVFS checks n <= length)."""
    kv: Handle
    n: Length


class KvExtract(KvCreate):
    """KV_EXTRACT: a new file of token ranges [start, end) of ``kv``."""
    kv: Handle
    ranges: Ranges


class KvMerge(KvCreate):
    """KV_MERGE: a new file of the files' tokens one after another."""
    kvs: Handles


class KvStat(_Body):
    """KV_STAT: of a handle or of a path (exactly one)."""
    kv: Optional[Handle] = None
    path: OptPath = None

    def __post_init__(self):
        if (self.kv is None) == (self.path is None):
            raise ValueError("stat needs exactly one of kv (a handle) and path")


class KvAdvise(_Body):
    """KV_ADVISE: a pager hint, one of normal, keep, drop_first, cache (the
    pager may delete the file when memory is short and nobody has it open) or
    expire (with seconds); KVFS checks the hint and its seconds."""
    kv: Handle
    hint: Str
    seconds: Seconds = None


class KvRename(_Body):
    """KV_RENAME: move ``old`` to ``new``."""
    old: Path
    new: Path


class KvLookup(_Body, kw_only=True):
    """KV_LOOKUP: the longest chain of ``n_keys`` keys (the call's int32 array: 4 words
    a key) written in directory ``dir`` by the caller or a ``trust``ed user, with
    ``block`` tokens a key, at most ``limit`` blocks of it (null: all); waits up to
    ``wait`` seconds while a longer one is being written; the result is a new file
    holding it (copy-on-write), anonymous, or with ``claim`` a chain file in ``dir``
    with these keys that others may wait for (``mode``; advised cache, expiring
    after ``ttl`` seconds; null: never).  KVFS checks the block against the page size."""
    dir: Path
    block: BlockSize
    n_keys: NKeys
    limit: Limit = None
    wait: Wait = 0.0
    claim: Flag = False
    trust: Optional[Trust] = None
    mode: Mode = None
    ttl: Ttl = None


class KvPublish(_Body, kw_only=True):
    """KV_PUBLISH: make the named file ``kv`` (read-write) a chain file of its
    directory with ``n_keys`` keys (the call's int32 array), replacing any it had;
    0 keys: no chain file any more."""
    kv: Handle
    block: BlockSize
    n_keys: NKeys
    ttl: Ttl = None


class Send(_Body):
    """SEND: a message (any JSON value) to the user who ran the LIP."""
    data: AnyJson


class WriteStream(_Body):
    """WRITE_STREAM: text the LIP printed."""
    stream: Stream
    data: Str


class Fetch(_Body):
    """FETCH: the next chunk of a reply too large for a slot."""
    id: ReplyId
    offset: Offset


class CapHttp(_Body):
    """CAP_HTTP: types only; the capability layer checks values against its policy."""
    url: Str
    method: Str = "GET"
    body: Optional[Str] = None
    headers: Headers = None
    timeout: Number = 10.0


class CapReadFile(_Body):
    """CAP_READ_FILE: a granted text file (the capability layer bounds max_bytes)."""
    path: Path
    max_bytes: Optional[int] = None


class CapListDir(_Body):
    """CAP_LIST_DIR: a granted directory."""
    path: Path


REQUESTS: dict[int, type] = {
    abi.NOP: Empty, abi.INFO: Empty, abi.RECV: Empty, abi.PRED: Pred,
    abi.KV_CREATE: KvCreate, abi.KV_OPEN: KvOpen, abi.KV_CLOSE: KvHandle, abi.KV_SYNC: KvHandle,
    abi.KV_REMOVE: KvPath, abi.KV_RMDIR: KvPath, abi.KV_LIST: KvPath, abi.KV_MKDIR: KvMkdir,
    abi.KV_FORK: KvFork, abi.KV_TRUNCATE: KvTruncate, abi.KV_EXTRACT: KvExtract, abi.KV_MERGE: KvMerge,
    abi.KV_STAT: KvStat, abi.KV_ADVISE: KvAdvise, abi.KV_RENAME: KvRename,
    abi.KV_LOOKUP: KvLookup, abi.KV_PUBLISH: KvPublish,
    abi.SEND: Send, abi.WRITE_STREAM: WriteStream, abi.FETCH: Fetch,
    abi.CAP_HTTP: CapHttp, abi.CAP_READ_FILE: CapReadFile, abi.CAP_LIST_DIR: CapListDir,
}
"""op -> the type of its request body (every op of the ABI has one)."""

_DECODERS = {op: msgspec.json.Decoder(t) for op, t in REQUESTS.items()}
_ENCODER = msgspec.json.Encoder()
_WHOLE = "a system call body must be a JSON object"


# ---------------------------------------------------------------- the two sides
def decode(op: int, raw: bytes):
    """The kernel side: ``raw`` (the ring's JSON bytes; empty means ``{}``) as op's
    type.  UnknownOp for an op without one; Undecodable for bytes that are not
    JSON; SchemaError (naming the field) for JSON that does not fit.  A small pred
    body is decoded once (a decode loop sends the same bytes each step): the same
    frozen `Pred` comes back for the same bytes."""
    if op == abi.PRED and len(raw) <= 256:
        body = _PREDS.get(raw)
        if body is None:
            body = _decode(op, raw)
            if len(_PREDS) >= 4096:
                _PREDS.clear()
            _PREDS[raw] = body
        return body
    return _decode(op, raw)


_PREDS: dict = {}       # small pred bodies -> their decoded Pred (the kernel's side; bounded)


def _decode(op: int, raw: bytes):
    dec = _DECODERS.get(op)
    try:
        if dec is None:
            msgspec.json.decode(raw or b"{}")          # not JSON: Undecodable, as for any op
            raise UnknownOp(f"unknown system call {op}")
        return dec.decode(raw or b"{}")
    except msgspec.ValidationError as e:
        raise _explain(REQUESTS[op], str(e), lambda: msgspec.json.decode(raw)) from None
    except msgspec.DecodeError as e:
        raise Undecodable(f"malformed JSON body: {e}") from None
    except RecursionError:
        raise Undecodable("malformed JSON body: nested too deeply") from None


def build(op: int, **fields):
    """The LIP side: op's body from keyword arguments, validated as `decode` would
    (SchemaError with the same message)."""
    try:
        return msgspec.convert(fields, REQUESTS[op])
    except msgspec.ValidationError as e:
        raise _explain(REQUESTS[op], str(e), lambda: fields) from None


def encode(body) -> bytes:
    """A body (a Struct from `build`) as the JSON bytes the ring carries."""
    return _ENCODER.encode(body)


def describe(tp: type, field: str) -> str:
    """What ``field`` of body type ``tp`` must be, in words."""
    return _FIELD_WORDS[tp].get(field, "absent (not a field of this call)")


# ---------------------------------------------------------------- helpers
def _explain(tp: type, msg: str, whole) -> SchemaError:
    """msgspec's ValidationError text -> a SchemaError whose message names the field
    and quotes the value given (``whole()``: the body as Python values)."""
    fields = tp.__struct_fields__
    if " - at `$." in msg:                               # a field's type or bounds
        field = msg.rsplit(" - at `$.", 1)[1].rstrip("`").split(".", 1)[0].split("[", 1)[0]
        try:
            got = f", got {whole()[field]!r}"
        except Exception:                               # only for the message
            got = ""
        return SchemaError(f"{field} must be {describe(tp, field)}{got}", field)
    if msg.startswith("Object missing required field `"):
        field = msg.split("`")[1]
        return SchemaError(f"{field} is required: {field} must be {describe(tp, field)}", field)
    if msg.startswith("Object contains unknown field `"):
        field = msg.split("`")[1]
        return SchemaError(f"unknown field {field[:64]!r} in a {tp.__name__} call "
                           f"(its fields: {', '.join(fields) or 'none'})", field[:64])
    if msg.startswith("Expected `object`"):
        return SchemaError(_WHOLE)
    text = msg.rsplit(" - at `$`", 1)[0]                 # a __post_init__ check: its own words
    first = text.split(" ", 1)[0]
    return SchemaError(text, first if first in fields else "")


def _words(t) -> str:
    """msgspec.inspect type info -> words ("an int in [1, 8192]")."""
    i = msgspec.inspect
    if isinstance(t, i.Metadata):
        must = (t.extra or {}).get("must")
        return must if must else _words(t.type)
    if isinstance(t, i.UnionType):
        words = " or ".join(_words(u) for u in t.types if not isinstance(u, i.NoneType))
        nullable = any(isinstance(u, i.NoneType) for u in t.types)
        return words + " or null" if nullable and "null" not in words else words
    if isinstance(t, i.BoolType):
        return "true or false"
    if isinstance(t, (i.IntType, i.FloatType)):
        return "an int" if isinstance(t, i.IntType) else "a number"
    if isinstance(t, i.StrType):
        return "a string"
    if isinstance(t, i.LiteralType):
        return f"one of {t.values}"
    if isinstance(t, (i.ListType, i.TupleType, i.VarTupleType)):
        return "a list"
    if isinstance(t, i.DictType):
        return "an object"
    return "any JSON value"


# every field's words, worked out at import (a LIP imports this before its sandbox is locked)
_FIELD_WORDS = {tp: {f.name: _words(f.type) for f in msgspec.inspect.type_info(tp).fields}
                for tp in set(REQUESTS.values())}
