"""The client RPC, declared once as types for both sides: a client (symphony.client, the
HTTP gateway) <-> the kernel's socket (Unix, or TCP for remote gateways: transport.py).

Frames are protocol.py's (a 4-byte length, then JSON).  A request is a JSON object
whose ``op`` names its type below; its other fields are exactly that type's (an
unknown one is refused), each checked for type and for the bounds that need no
kernel state.  Both sides use the same check with the same message::

    client   check_request({"op": "kill", "lip": "x"})  ->  RpcError("lip must be a LIP id ...")
    kernel   decode_request(frame)                     ->  the same RpcError, answered as EINVAL

What depends on the kernel's state (whether a LIP or a path exists, who may act for
whom, the capability policy, the administrator's ceilings) stays with the kernel.
Replies and events are checked by the client as they arrive (`check_reply`,
`check_event`): a field the kernel sends that the client does not know is kept
(a newer kernel), one of the wrong type is a `ReplyError`.

Every reply is one of: the op's reply type below; `Error` (``{"error": code,
"type", "message"}``: the request was refused and changed nothing).  A spawn with
``attach`` then streams the LIP's events (`EVENTS`) on the same connection, up to
its exit.  A KV file's bytes travel as **raw frames**: a 4-byte big-endian length
with its top bit set (``RAW``), then that many bytes (at most `CHUNK_BYTES`), never
JSON: ``kv_export`` answers `ExportHead`, then ``chunks`` raw frames; ``kv_import``
is followed by its ``chunks`` raw frames before its reply.  (A raw frame where a
request is expected reads as a frame over the size limit: the connection closes.)
The reference page docs/reference/client-rpc.md is generated from these types.
"""
from __future__ import annotations

import asyncio
import struct
from typing import Annotated, Any, Literal, Optional, Union

import msgspec
import msgspec.inspect
from msgspec import Meta

__all__ = ["RpcError", "ReplyError", "REQUESTS", "REPLIES", "EVENTS", "decode_request", "check_request",
           "check_reply", "check_event", "describe", "Spawn", "Input", "Kill", "Ps", "Stats", "KvLs", "KvStat",
           "KvRm", "KvExport", "KvImport", "KvAdopt", "Drain", "Shutdown", "TestHook", "Error", "Started",
           "Queued", "Out", "Stdout", "Stderr", "Exit", "Ok", "PsReply", "StatsReply", "KvLsReply",
           "KvStatReply", "ExportHead", "Imported", "Adopted", "raw_frames", "raw_length", "read_raw", "recv_raw_sync", "MAX_SOURCE_BYTES", "CHUNK_BYTES",
           "MAX_TRANSFER_BYTES", "RAW"]

MAX_SOURCE_BYTES = 4 << 20          # a LIP's source text
MAX_FILENAME = 4096
MAX_PATH = 4096
CHUNK_BYTES = 4 << 20               # bytes of KV data per raw frame of an export or import
RAW = 0x80000000                    # the length word's top bit: a raw frame
MAX_TRANSFER_BYTES = 1 << 40        # a KV file moved in one export or import (the kernel bounds it by quota)
USER_PATTERN = r"^[a-z_][a-z0-9_-]{0,31}$"


class RpcError(ValueError):
    """A request that does not fit its type; ``field`` names the culprit ('' for the frame)."""

    code = "EINVAL"

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


class ReplyError(ConnectionError):
    """A reply or event from the kernel that does not fit its type (another release, or
    not a Symphony kernel): the connection cannot be trusted further."""


# ---------------------------------------------------------------- field types
def _must(tp, words: str, **bounds):
    return Annotated[tp, Meta(**bounds, extra={"must": words})]


User = Optional[_must(str, "a KVFS user name ([a-z_][a-z0-9_-]*, at most 32)", pattern=USER_PATTERN)]
LipId = _must(int, "a LIP id (an int >= 1)", ge=1)
KvPath = _must(str, f"a KVFS path (a string of at most {MAX_PATH} characters)", min_length=1, max_length=MAX_PATH)
Source = _must(str, f"the program's text (a string of at most {MAX_SOURCE_BYTES} characters)",
               max_length=MAX_SOURCE_BYTES)
Filename = _must(str, f"a file name (a string of at most {MAX_FILENAME} characters)", max_length=MAX_FILENAME)
Args = _must(list[str], "a list of strings")
Flag = _must(bool, "true or false")
Priority = _must(Union[int, str], "a priority class (batch, normal, interactive) or an int")
KvTokens = Optional[_must(int, "an int >= 0 (KV tokens the LIP is expected to need)", ge=0)]
Limits = Optional[_must(dict[str, Union[int, float, None]], "an object of limit names to numbers")]
Hosts = _must(list[str], "a list of strings")
Bytes = _must(int, f"a size in bytes (an int in [1, {MAX_TRANSFER_BYTES}])", ge=1, le=MAX_TRANSFER_BYTES)
Sha256 = _must(str, "a SHA-256 digest (64 hex digits)", pattern=r"^[0-9a-f]{64}$")
Count = _must(int, "an int >= 0", ge=0)
Mode = Optional[_must(int, "a permission mode (an int in [0, 0o777])", ge=0, le=0o777)]
Text = _must(str, "a string")
Seconds = Optional[_must(float, "a number of seconds", ge=0)]


class Grants(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What a LIP may reach through the kernel (checked against the kernel's policy)."""
    http: Hosts = []
    read: Hosts = []


# ---------------------------------------------------------------- requests
class _Request(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """A request; ``user``: the KVFS user to act as (root, the trusted gateway, or a remote
    gateway over TCP may name one; a remote gateway must)."""
    user: User = None


class Spawn(_Request, tag="spawn"):
    """Start a LIP from its source text; answered `Started` or `Queued`, then (attached) its events."""
    source: Source
    filename: Filename = "lip.py"
    args: Args = []
    grants: Optional[Grants] = None
    limits: Limits = None
    attach: Flag = True
    priority: Priority = "normal"
    kv_tokens: KvTokens = None


class Input(_Request, tag="input"):
    """A line for a LIP's recv(), or (``eof``) the end of its input; no reply unless refused."""
    lip: LipId
    data: Optional[Text] = None
    eof: Flag = False

    def __post_init__(self):
        if (self.data is None) != self.eof:
            raise ValueError("input needs exactly one of data (a string) and eof (true)")


class Kill(_Request, tag="kill"):
    """Kill a LIP (its owner, or root); answered `Ok`."""
    lip: LipId


class Ps(_Request, tag="ps"):
    """The live LIPs (others' without their arguments); answered `PsReply`."""


class Stats(_Request, tag="stats"):
    """The kernel's counters, model and state; answered `StatsReply`."""


class KvLs(_Request, tag="kv_ls"):
    """A KVFS directory's entries, as the user sees them; answered `KvLsReply`."""
    path: KvPath = "/"


class KvStat(_Request, tag="kv_stat"):
    """A KV file's or directory's metadata; answered `KvStatReply`."""
    path: KvPath


class KvRm(_Request, tag="kv_rm"):
    """Remove a KV file; answered `Ok`."""
    path: KvPath


class KvExport(_Request, tag="kv_export"):
    """A KV file's bytes, if the user may read it: answered `ExportHead`, then its raw frames."""
    path: KvPath


class KvImport(_Request, tag="kv_import"):
    """A KV file made from exported bytes at ``path`` (``sha256``: the digest the bytes carry in
    their last 32 bytes, which the kernel checks against their content; created as the user, under the user's
    quota; refused if another model wrote it or a byte differs; ``parents``: make the
    missing directories above it, as the user); ``chunks`` raw frames of its ``size``
    bytes follow this one, then the kernel answers `Imported`."""
    path: KvPath
    size: Bytes
    sha256: Sha256
    chunks: Count
    mode: Mode = None
    parents: Flag = False


class KvAdopt(_Request, tag="kv_adopt"):
    """Import the durable files another kernel left (``peer``: its durable directory's id,
    one this kernel was given with --peer-durable-dir) that lie below ``dir`` and that the
    user owned, each at its own path; answered `Adopted`."""
    peer: _must(str, "a durable directory's id (hex)", pattern=r"^[0-9a-f]{16,64}$")
    dir: KvPath


class Drain(_Request, tag="drain"):
    """Stop taking new LIPs (spawns are refused, type Draining) while those running finish,
    so that a gateway moves their users elsewhere (root only); answered `Ok`."""


class Shutdown(_Request, tag="shutdown"):
    """Stop the kernel (root only); answered `Ok`."""


class TestHook(_Request, tag="test_hook"):
    """Fault injection (a kernel started with --test-hooks, root only)."""
    hook: Text
    seconds: Seconds = None


REQUESTS = (Spawn, Input, Kill, Ps, Stats, KvLs, KvStat, KvRm, KvExport, KvImport, KvAdopt, Drain, Shutdown,
            TestHook)
Request = Union[REQUESTS]


# ---------------------------------------------------------------- replies and events
class _Reply(msgspec.Struct, kw_only=True):
    """A reply: the fields below checked, others the kernel adds kept."""


class Error(_Reply):
    """The request was refused and changed nothing: an errno-style ``error`` code, the
    exception's ``type``, a ``message`` for people."""
    error: str
    type: Optional[str] = None
    message: str = ""


class _Event(_Reply, tag_field="event"):
    pass


class Started(_Event, tag="started"):
    """The LIP runs (``waited_s``: how long it waited in the admission queue, if it did)."""
    lip: int
    waited_s: Optional[float] = None


class Queued(_Event, tag="queued"):
    """The LIP waits in the admission queue (``position``, ``waiting_for`` in words)."""
    lip: int
    position: int
    waiting_for: str = ""


class Out(_Event, tag="out"):
    """A message the LIP sent (any JSON value)."""
    data: Any = None


class Stdout(_Event, tag="stdout"):
    """Text the LIP printed."""
    data: str = ""


class Stderr(_Event, tag="stderr"):
    """Text the LIP printed to stderr."""
    data: str = ""


class Exit(_Event, tag="exit"):
    """The LIP ended: ``status`` (128 + signal if killed), ``reason``; ``lost``: made up by
    the client because the connection ended first."""
    status: int
    lip: Optional[int] = None
    reason: Optional[str] = None
    lost: bool = False


class Ok(_Reply):
    """Done (``lip``: the LIP a kill named)."""
    ok: bool
    lip: Optional[int] = None


class PsReply(_Reply):
    """Live LIPs and the last finished ones (``more``: rows left out to fit a frame)."""
    lips: list[dict]
    finished: list[dict] = []
    more: Optional[dict] = None


class StatsReply(_Reply):
    """What the gateway routes by (and many counters besides)."""
    instance: str
    model: str
    model_name: Optional[str] = None
    page_size: int = 16
    context: int = 2048
    kv_pages_total: int = 0
    draining: bool = False
    durable_id: Optional[str] = None     # its durable directory's id (files a peer may adopt)
    peers: list[str] = []                # the ids of the durable directories it may adopt from


class KvLsReply(_Reply):
    entries: list[dict]
    more: Optional[dict] = None


class KvStatReply(_Reply):
    type: Literal["file", "dir"]
    path: str
    owner: str
    mode: int


class ExportHead(_Reply):
    """An export's first frame: the file's ``header`` (path, owner, length, dtype, model
    fingerprint, ...), its ``size`` in bytes, ``sha256`` (of the header and data: the
    digest the bytes end with) and the ``chunks`` (raw frames) that follow."""
    header: dict
    size: int
    sha256: str
    chunks: int


class Imported(_Reply):
    """The imported file: its ``path``, ``length`` in tokens and ``pages``."""
    path: str
    length: int
    pages: int


class Adopted(_Reply):
    """The paths adopted, and the files refused with why."""
    adopted: list[str]
    refused: list[list[str]] = []


REPLIES: dict[type, Any] = {
    Spawn: Union[Started, Queued], Input: Error, Kill: Ok, Ps: PsReply, Stats: StatsReply, KvLs: KvLsReply,
    KvStat: KvStatReply, KvRm: Ok, KvExport: ExportHead, KvImport: Imported, KvAdopt: Adopted, Drain: Ok, Shutdown: Ok,
    TestHook: Ok}
"""request type -> the type of its reply (besides `Error`; an input has no other reply)."""

EVENTS = Union[Started, Queued, Out, Stdout, Stderr, Exit]
"""What an attached connection streams after a spawn's reply."""

_BY_OP = {t.__struct_config__.tag: t for t in REQUESTS}
_REQUEST_DECODER = msgspec.json.Decoder(Request)


# ---------------------------------------------------------------- the two sides
def decode_request(frame) -> _Request:
    """The kernel side: a request frame (bytes, or the dict protocol.py decoded) as its
    typed request; RpcError naming the field."""
    try:
        if isinstance(frame, (bytes, bytearray, memoryview)):
            return _REQUEST_DECODER.decode(frame)
        return msgspec.convert(frame, Request)
    except msgspec.ValidationError as e:
        raise _explain(str(e), frame) from None
    except msgspec.DecodeError as e:
        raise RpcError(f"a request frame that is not JSON: {e}") from None


def check_request(msg: dict) -> _Request:
    """The client side: ``msg`` checked as the kernel will (the same RpcError)."""
    return decode_request(msg)


def check_reply(req: _Request, reply: dict) -> dict:
    """The client side: the kernel's ``reply`` to ``req``, checked (ReplyError if it does
    not fit); returned as it came (with any fields this client does not know)."""
    tp = Error if isinstance(reply, dict) and "error" in reply else REPLIES[type(req)]
    try:
        msgspec.convert(reply, tp)
    except msgspec.ValidationError as e:
        raise ReplyError(f"the kernel's reply to {type(req).__struct_config__.tag} does not fit its type: {e}") from None
    return reply


def check_event(ev: dict) -> dict:
    """The client side: one event of an attached LIP, checked (ReplyError if malformed)."""
    try:
        msgspec.convert(ev, EVENTS)
    except msgspec.ValidationError as e:
        raise ReplyError(f"an event from the kernel does not fit its type: {e}") from None
    return ev


def raw_frames(blob) -> list[tuple[bytes, memoryview]]:
    """``blob`` as raw frames of at most `CHUNK_BYTES` each (at least one): (header, data)
    pairs to send one after the other (the data a view of ``blob``, not a copy)."""
    view = memoryview(blob)
    return [(struct.pack(">I", RAW | len(view[o:o + CHUNK_BYTES])), view[o:o + CHUNK_BYTES])
            for o in range(0, max(1, len(view)), CHUNK_BYTES)]


def raw_length(head: bytes) -> int:
    """The length a raw frame's 4-byte header announces (RpcError if it is not one)."""
    (n,) = struct.unpack(">I", head)
    if not n & RAW:
        raise RpcError("expected a raw frame of KV data, got a JSON frame")
    n &= ~RAW
    if n > CHUNK_BYTES:
        raise RpcError(f"a raw frame of {n} bytes (at most {CHUNK_BYTES})")
    return n


async def read_raw(reader: asyncio.StreamReader) -> bytes:
    """One raw frame's bytes from ``reader`` (RpcError, asyncio.IncompleteReadError)."""
    return await reader.readexactly(raw_length(await reader.readexactly(4)))


def recv_raw_sync(sock) -> bytes:
    """One raw frame's bytes from a blocking socket (RpcError; ConnectionError if it closes)."""
    def exactly(n):
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = sock.recv_into(view[got:])
            if not k:
                raise ConnectionError("the kernel closed the connection inside a KV data frame")
            got += k
        return bytes(buf)
    return exactly(raw_length(exactly(4)))


def describe(tp: type, field: str) -> str:
    """What ``field`` of request type ``tp`` must be, in words."""
    return _WORDS[tp].get(field, "absent (not a field of this request)")


# ---------------------------------------------------------------- helpers
def _explain(msg: str, frame) -> RpcError:
    """msgspec's message -> one naming the field, what it must be and what was given."""
    op = frame.get("op") if isinstance(frame, dict) else None
    tp = _BY_OP.get(op)
    if msg.startswith("Object missing required field `op`") or "- at `$.op`" in msg:
        ops = ", ".join(sorted(_BY_OP))
        what = "a request needs an op" if op is None else f"unknown op {str(op)[:64]!r}"
        return RpcError(f"{what}: a request's op is one of {ops}", "op")
    if msg.startswith("Expected `object`"):
        return RpcError("a request must be a JSON object")
    if " - at `$." in msg and tp is not None:
        field = msg.rsplit(" - at `$.", 1)[1].rstrip("`").split(".", 1)[0].split("[", 1)[0]
        got = f", got {frame.get(field)!r}"[:200] if isinstance(frame, dict) and field in frame else ""
        return RpcError(f"{op}: {field} must be {describe(tp, field)}{got}", field)
    if msg.startswith("Object missing required field `") and tp is not None:
        field = msg.split("`")[1]
        return RpcError(f"{op}: {field} is required: {field} must be {describe(tp, field)}", field)
    if msg.startswith("Object contains unknown field `") and tp is not None:
        field = msg.split("`")[1][:64]
        return RpcError(f"{op}: unknown field {field!r} (its fields: {', '.join(tp.__struct_fields__)})", field)
    return RpcError(f"{op}: {msg.rsplit(' - at `$`', 1)[0]}" if op else msg)


def _words(t) -> str:
    i = msgspec.inspect
    if isinstance(t, i.Metadata):
        return (t.extra or {}).get("must") or _words(t.type)
    if isinstance(t, i.UnionType):
        parts = [_words(u) for u in t.types if not isinstance(u, i.NoneType)]
        null = any(isinstance(u, i.NoneType) for u in t.types)
        return " or ".join(parts) + (" or null" if null else "")
    if isinstance(t, i.StructType):
        return f"an object of {', '.join(f.name for f in t.fields)}"
    return {i.BoolType: "true or false", i.IntType: "an int", i.FloatType: "a number",
            i.StrType: "a string"}.get(type(t), "any JSON value")


_WORDS = {tp: {f.name: _words(f.type) for f in msgspec.inspect.type_info(tp).fields} for tp in REQUESTS}
