"""The LIP library's implementation: system calls over the shared-memory ring.

Every call's body is built with its op's type from `symphony.ipc.schema` (`_sys`),
so a bad argument is refused here, in the LIP, with the message the kernel would
give (InvalidArgument), before anything crosses the ring.
"""
from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

import numpy as np
import orjson

from symphony.ipc import abi, schema
from .errors import BY_NAME, InvalidArgument, NotInLIP, SyscallError

_ring = None          # symphony.ipc.lip_side.LipSide, set by the worker before user code runs
_tok = None           # symphony.tokenizer.Tokenizer
_eos: tuple = ()
EOS: int = -1         # the model's (first) end-of-sequence token id, set at attach (-1 outside a LIP)
ATTACHED = ("EOS",)   # globals set by attach: `symphony.lip` reads them here at each access
_local = threading.local()
_bodies: dict = {}    # pred's encoded bodies by their arguments (a decode loop sends the same one each step)


def attach(ring, tok) -> None:
    """Point the library at the LIP's ring (a `symphony.ipc.lip_side.LipSide`) and the model's
    tokenizer: the LIP worker (symphony.kernel.workers.zygote) calls it once, before the program runs."""
    global _ring, _tok, _eos, EOS
    _ring, _tok = ring, tok
    _eos = tok.eos_ids
    EOS = tok.eos_id if tok.eos_id is not None else -1


def detach() -> None:
    """Back to no ring (what a process that is no LIP sees: every call raises NotInLIP)."""
    global _ring, _tok, _eos, EOS
    _ring, _tok, _eos, EOS = None, None, (), -1


def _sys(op: int, tokens: Optional[np.ndarray] = None, **fields):
    """System call ``op`` with the body ``fields``, checked against the op's schema first."""
    try:
        body = schema.build(op, **fields)
    except schema.SchemaError as e:
        raise InvalidArgument(str(e), "EINVAL") from None
    return _call(op, body, tokens)


def _call(op: int, body=None, tokens: Optional[np.ndarray] = None):
    """System call ``op``: ``body`` a schema Struct (see `_sys`), its encoding (bytes), a raw
    dict (sent unchecked: the kernel checks), or None -> (reply dict, arena or None)."""
    if _ring is None:
        raise NotInLIP("symphony.lip calls work only inside a LIP run by the kernel (symphony run)")
    raw = (b"" if body is None else body if isinstance(body, bytes) else orjson.dumps(body) if isinstance(body, dict)
           else schema.encode(body))
    r = _ring.call(op, raw, tokens)
    raw = r.json
    if r.status == abi.CHUNKED:                    # too large for a slot: fetch it in chunks
        raw = _fetch_chunks(r.json)
    elif r.status != abi.OK:
        _raise(r.json)
    return (orjson.loads(raw) if raw else {}), r.arena


def _raise(raw: bytes):
    """Raise the exception an error reply names."""
    try:
        data = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    cls = BY_NAME.get(data.get("type"), SyscallError)
    raise cls(str(data.get("message", "system call failed")), data.get("error", "EIO"))


def _fetch_chunks(marker: bytes) -> bytes:
    """The whole body of a chunked reply (see symphony/kernel/syscall/replies.py)."""
    m = orjson.loads(marker)
    rid, size = m["chunked"], m["size"]
    parts, got = [], 0
    while got < size:
        r = _ring.call(abi.FETCH, schema.encode(schema.build(abi.FETCH, id=rid, offset=got)))
        if r.status != abi.OK:
            _raise(r.json)
        if not r.json:
            raise SyscallError(f"chunked reply {rid} ended at {got} of {size} bytes", "EIO")
        parts.append(r.json)
        got += len(r.json)
    return b"".join(parts)


def _tokens(t) -> np.ndarray:
    if isinstance(t, (int, np.integer)) and not isinstance(t, bool):
        t = [t]
    a = np.asarray(t)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise BY_NAME["InvalidArgument"](f"tokens must be a 1-D sequence of ints, got {a.dtype} {a.shape}",
                                         "EINVAL")
    return a.astype(np.int32, copy=False)


# ---------------------------------------------------------------- tokenizer (local)
def tokenizer():
    """The model's `Tokenizer` (encode, decode, apply_chat_template, eos_ids...)."""
    if _tok is None:
        raise NotInLIP("no tokenizer: not inside a LIP")
    return _tok


def tokenize(text: str) -> list[int]:
    return tokenizer().encode(text)


def detokenize(tokens) -> str:
    return tokenizer().decode(_tokens(tokens).tolist())


# ---------------------------------------------------------------- pred
def pred(f: "KVFile", tokens, positions=None, *, all_logits: bool = False, output: str = "logits",
         k: int = 20, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
         seed: Optional[int] = None, mask: Optional[Sequence[int]] = None, logit_bias=None,
         min_p: float = 0.0):
    """Append ``tokens`` to KV file ``f`` and run the model.

    ``output``:
      * ``"logits"`` (default): float32 logits, a zero-copy NumPy view ``[vocab]``
        (``[n, vocab]`` with ``all_logits``), valid until this thread's next call;
      * ``"topk"``: ``(ids int32 [k], logprobs float32 [k])`` (rows with all_logits);
      * ``"sample"``: a token id sampled in the kernel (``temperature``, then
        ``top_k``, ``top_p``, ``min_p`` (drop tokens less likely than min_p times the
        most likely one; 0: off); ``seed``); ``"argmax"``: the greedy token id.
    ``mask``: the tokens allowed next, as a list of ids or a bitmask of
    ceil(vocab/32) uint32 words (see `mask_words`); all others get -inf in the
    kernel before any output.
    ``logit_bias``: ``{token id: bias}`` or ``[(token id, bias), ...]`` (at most
    1024 tokens, each once, bias in [-100, 100]): added to the logits in the
    kernel before the mask and before any output (the logits returned, top-k,
    argmax, sampling), as OpenAI's ``logit_bias`` is.
    """
    if not isinstance(f, KVFile):
        raise BY_NAME["InvalidArgument"]("pred needs a KVFile", "EINVAL")
    toks = _tokens(tokens)
    n, n_mask = int(toks.size), 0
    if mask is not None:
        words = mask_words(mask)
        n_mask = int(words.size)
        toks = np.concatenate([toks, words.view(np.int32)])
    if positions is None and logit_bias is None:   # a decode step repeats the last one's body: built once
        key = (f.handle, n, n_mask, bool(all_logits), output, k, temperature, top_p, top_k, seed, min_p,
               type(k), type(temperature), type(top_p), type(top_k), type(seed), type(min_p))  # (True is not 1)
        try:
            body = _bodies.get(key)
        except TypeError:                          # an unhashable argument: the schema refuses it below
            body, key = None, None
        if body is None:
            try:
                body = schema.build(abi.PRED, kv=f.handle, n_tokens=n, n_mask_words=n_mask, positions=None,
                                    all_logits=bool(all_logits), output=output, k=k, temperature=temperature,
                                    top_p=top_p, top_k=top_k, seed=seed, min_p=min_p)
            except schema.SchemaError as e:
                raise InvalidArgument(str(e), "EINVAL") from None
            body = schema.encode(body)
            if key is not None:
                if len(_bodies) >= 256:
                    _bodies.clear()
                _bodies[key] = body
        data, arena = _call(abi.PRED, body, toks)
    else:
        data, arena = _sys(abi.PRED, toks, kv=f.handle, n_tokens=n, n_mask_words=n_mask,
                           positions=None if positions is None else _tokens(positions).tolist(),
                           all_logits=bool(all_logits), output=output, k=k, temperature=temperature,
                           top_p=top_p, top_k=top_k, seed=seed, min_p=min_p, logit_bias=_bias_pairs(logit_bias))
    f._length = data.get("length", f._length)
    if output in ("sample", "argmax"):
        return data["token"] if not all_logits else data["tokens"]
    if output == "topk":
        ids, lp = arena                                # a TopK: int32 [rows, k], float32 [rows, k]
        return (ids[0], lp[0]) if not all_logits else (ids, lp)
    return arena if all_logits else arena[0]


def _bias_pairs(bias):
    """A logit_bias as the schema takes it: None, or [(token id, bias), ...]."""
    if bias is None:
        return None
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        return [(int(t) if isinstance(t, (np.integer,)) else t, float(v) if isinstance(v, np.floating) else v)
                for t, v in items]
    except (TypeError, ValueError):
        raise InvalidArgument("logit_bias must be {token id: bias} or a list of (token id, bias) pairs",
                              "EINVAL") from None


def vocab_size() -> int:
    """The model's vocabulary size (logit rows have this many entries)."""
    v = getattr(_local, "vocab", None) or globals().get("_vocab")
    if v is None:
        v = info()["vocab_size"]
        globals()["_vocab"] = v
    return v


def mask_words(mask) -> np.ndarray:
    """A token mask as the kernel takes it: a bitmask of ceil(vocab/32) uint32
    words, bit i set = token i allowed.  ``mask`` is either such a bitmask
    (uint32 or int32 array of that length, e.g. from a grammar engine) or a
    sequence of allowed token ids."""
    n = (vocab_size() + 31) // 32
    m = np.asarray(mask)
    if m.dtype in (np.uint32, np.int32) and m.ndim == 1 and m.size == n:
        return m.view(np.uint32)
    ids = _tokens(m).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size()):
        raise BY_NAME["InvalidArgument"]("mask holds token ids outside the vocabulary", "EINVAL")
    words = np.zeros(n, dtype=np.uint32)
    np.bitwise_or.at(words, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
    return words


# ---------------------------------------------------------------- KV files
def _key_words(keys) -> np.ndarray:
    """Chain keys (bytes, 16 a key) as the call's int32 array."""
    if not isinstance(keys, (bytes, bytearray)) or len(keys) % 16:
        raise InvalidArgument("keys must be bytes, 16 for each key", "EINVAL")
    return np.frombuffer(bytes(keys), dtype="<i4").astype(np.int32)


class KVFile:
    """A handle to a KV file.  Use as a context manager to close it."""

    __slots__ = ("handle", "path", "writable", "_length", "_closed")

    def __init__(self, handle: int, path: Optional[str], writable: bool, length: int = 0):
        self.handle, self.path, self.writable, self._length, self._closed = handle, path, writable, length, False

    def __repr__(self):
        return f"KVFile({self.path or 'anonymous'}, handle={self.handle}, {'rw' if self.writable else 'r'})"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __len__(self):
        return self._length

    def fork(self, path: Optional[str] = None, mode: Optional[int] = None) -> "KVFile":
        """A copy-on-write clone, anonymous unless ``path``; ``mode`` as in `kv.create`."""
        d, _ = _sys(abi.KV_FORK, kv=self.handle, path=path, mode=mode)
        return KVFile(d["handle"], path, True, d["length"])

    def close(self) -> None:
        if not self._closed:
            _sys(abi.KV_CLOSE, kv=self.handle)
            self._closed = True

    def truncate(self, n: int) -> None:
        d, _ = _sys(abi.KV_TRUNCATE, kv=self.handle, n=n)
        self._length = d["length"]

    def extract(self, ranges, path: Optional[str] = None, mode: Optional[int] = None) -> "KVFile":
        d, _ = _sys(abi.KV_EXTRACT, kv=self.handle, ranges=ranges, path=path, mode=mode)
        return KVFile(d["handle"], path, True, d["length"])

    def stat(self) -> dict:
        d, _ = _sys(abi.KV_STAT, kv=self.handle)
        self._length = d["length"]
        return d

    def advise(self, hint: str, seconds: Optional[float] = None) -> None:
        """A pager hint for this file: "normal"; "keep" (never evicted);
        "drop_first" (swapped out before others); "cache" (when memory is
        short the kernel may *delete* the file if no handle has it open, least
        recently used first: a later open raises NotFound and you recompute
        it); "expire" with ``seconds`` (removed from the namespace then)."""
        _sys(abi.KV_ADVISE, kv=self.handle, hint=hint, seconds=seconds)

    def sync(self) -> None:
        _sys(abi.KV_SYNC, kv=self.handle)

    def publish(self, keys: bytes, block: int, ttl: Optional[float] = None) -> None:
        """Make this named file a chain file of its directory (see `kv.lookup`):
        ``keys`` (16 bytes each, concatenated) name its first blocks of ``block``
        tokens, replacing any keys it had (b"": none).  Needs a read-write handle."""
        _sys(abi.KV_PUBLISH, _key_words(keys), kv=self.handle, block=block, n_keys=len(keys) // 16, ttl=ttl)

    def remove(self) -> None:
        """Close the handle and, for a named file, unlink it."""
        path = self.path
        self.close()
        if path:
            kv.remove(path)


class _KV:
    """The ``kv`` namespace: KVFS system calls that are not on a handle."""

    @staticmethod
    def create(path: Optional[str] = None, mode: Optional[int] = None) -> KVFile:
        """A new file opened read-write; anonymous unless ``path``.  ``mode``
        None: private (0600); the kernel's umask (default 022) is cleared from
        any mode asked for, e.g. 0o644 shares it read-only with every user."""
        d, _ = _sys(abi.KV_CREATE, path=path, mode=mode)
        return KVFile(d["handle"], path, True, 0)

    @staticmethod
    def open(path: str, mode: str = "r") -> KVFile:
        d, _ = _sys(abi.KV_OPEN, path=path, mode=mode)
        return KVFile(d["handle"], path, mode == "rw", d["length"])

    @staticmethod
    def merge(files: Sequence[KVFile], path: Optional[str] = None, mode: Optional[int] = None) -> KVFile:
        d, _ = _sys(abi.KV_MERGE, kvs=[f.handle for f in files], path=path, mode=mode)
        return KVFile(d["handle"], path, True, d["length"])

    @staticmethod
    def lookup(dir: str, keys: bytes, block: int, *, limit: Optional[int] = None, wait: float = 0.0,
               claim: bool = False, trust: Sequence[str] = (), mode: Optional[int] = None,
               ttl: Optional[float] = None) -> KVFile:
        """The longest cached prefix among the chain files of ``dir``: a new file,
        read-write, holding its first ``len(f)`` tokens (whole blocks of ``block``
        tokens, at most ``limit`` blocks; 0 on a miss), copy-on-write.  ``keys``:
        the prompt's chain keys, 16 bytes a block, concatenated (key i names blocks
        0..i, e.g. a hash chain of their tokens).  Files count when owned by you
        or a ``trust``ed user, readable by you and writable by nobody else.
        ``wait``: seconds to wait while a longer prefix is being written by
        another LIP (it ends early if that LIP stops making progress or closes
        it).  ``claim``: the result is itself a chain file in ``dir`` (random
        name, ``f.path``) with ``keys``, advised "cache", expiring after ``ttl``
        seconds: others' lookups find its blocks as you write them, and wait
        for them; without the right to claim (no write permission, no quota
        room) it is anonymous (``f.path`` None)."""
        d, _ = _sys(abi.KV_LOOKUP, _key_words(keys), dir=dir, block=block, n_keys=len(keys) // 16,
                    limit=limit, wait=wait, claim=claim, trust=list(trust) or None, mode=mode, ttl=ttl)
        return KVFile(d["handle"], d["path"], True, d["length"])

    @staticmethod
    def remove(path: str) -> None:
        _sys(abi.KV_REMOVE, path=path)

    @staticmethod
    def stat(path: str) -> dict:
        return _sys(abi.KV_STAT, path=path)[0]

    @staticmethod
    def list(path: str = "/") -> list:
        return _sys(abi.KV_LIST, path=path)[0]["entries"]

    @staticmethod
    def mkdir(path: str, mode: Optional[int] = None) -> None:
        """A new directory; ``mode`` None: private (0700), less the kernel's umask."""
        _sys(abi.KV_MKDIR, path=path, mode=mode)

    @staticmethod
    def rmdir(path: str) -> None:
        _sys(abi.KV_RMDIR, path=path)

    @staticmethod
    def rename(old: str, new: str) -> None:
        _sys(abi.KV_RENAME, old=old, new=new)


kv = _KV()


# ---------------------------------------------------------------- messages and capabilities
def send(msg: Any) -> None:
    """Send a message (str, or anything JSON-serialisable) to the user who ran the LIP."""
    _sys(abi.SEND, data=msg)


def recv() -> Optional[str]:
    """The next line of input from the user; None at end of input."""
    d, _ = _sys(abi.RECV)
    return None if d.get("eof") else d["data"]


def http(url: str, method: str = "GET", body: Optional[str] = None, headers: Optional[dict] = None,
         timeout: float = 10.0) -> dict:
    """HTTP through the kernel, to hosts the LIP was granted (``--grant http:HOST``).
    Returns {"status": int, "headers": {...}, "body": str}."""
    return _sys(abi.CAP_HTTP, url=url, method=method, body=body, headers=headers or {}, timeout=timeout)[0]


def read_file(path: str, max_bytes: int = 1 << 20) -> str:
    """Read a text file under a directory the LIP was granted (``--grant read:DIR``)."""
    return _sys(abi.CAP_READ_FILE, path=path, max_bytes=max_bytes)[0]["data"]


def list_dir(path: str) -> list:
    """List a directory under a granted directory."""
    return _sys(abi.CAP_LIST_DIR, path=path)[0]["entries"]


def info() -> dict:
    """This LIP's id, user, grants, limits and the model's vocabulary size and context."""
    return _sys(abi.INFO)[0]


def capabilities() -> dict:
    return info()["grants"]


def write_stream(stream: str, text: str) -> None:
    """Send ``text`` to the client's ``stream`` ("stdout" or "stderr"): the worker's sys.stdout
    and sys.stderr write through this."""
    _sys(abi.WRITE_STREAM, stream=stream, data=text)
