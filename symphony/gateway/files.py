"""Files a client sends inline (``file_data`` as a ``data:`` URL): text files as they
are, PDFs as the text pypdf reads from them.

A PDF is read in a worker thread, never on the gateway's event loop: before a route
turns a request into a prompt, `read_pdfs` finds every inline PDF in the request's
JSON and reads them all, one job per request in a pool of `PDF_WORKERS` threads, and
`inline_text` then takes each PDF's text from what was read (it reads one itself only
for a request that did not pass through `read_pdfs`, such as a unit test's).  A large
or hostile file therefore delays its own request, not the others of this gateway
process; and one key has at most one job in the pool at a time (its other PDF
requests wait their turn outside it), so a key sending many PDFs holds one of the
pool's threads, never all of them.  Bounds: at most `MAX_PDF_BYTES` a file, its first `MAX_PDF_PAGES` pages and
`MAX_INLINE_TEXT` characters; the table rebuild of a file without one scans linearly.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import contextvars
import io
import logging
import re
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Optional

import orjson

from .errors import ApiError

MAX_INLINE_TEXT = 1 << 20
TEXT_TYPES = ("text/", "application/json", "application/xml", "application/x-yaml", "application/yaml")
PDF_URL = "data:application/pdf"
PDF_WORKERS = 2                     # threads reading PDFs, for the whole gateway process

_pool: Optional[ThreadPoolExecutor] = None
# per event loop, per key: the key's one job in the pool (the keys are the operator's, so few)
_turns: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]]" = weakref.WeakKeyDictionary()
_read: contextvars.ContextVar[Optional[dict[str, Optional[str]]]] = contextvars.ContextVar("pdfs", default=None)


def inline_text(data: Optional[str], at: str) -> tuple[Optional[str], str]:
    """(the text of an inline text file or PDF, or None; what the data is)."""
    if not isinstance(data, str) or not data.startswith("data:") or "," not in data:
        return None, "a file that is not inline (file_data as a data: URL)"
    try:
        mime, raw = _decoded(data)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{at}: file_data is not valid base64", param=f"{at}.file_data") from None
    if mime.startswith(TEXT_TYPES) and len(raw) <= MAX_INLINE_TEXT:
        try:
            return raw.decode("utf-8"), mime
        except UnicodeDecodeError:
            pass
    if mime == "application/pdf" and len(raw) <= MAX_PDF_BYTES:
        read = _read.get()
        text = read[data] if read is not None and data in read else pdf_text(raw)
        if text:
            return text, mime
    return None, f"{mime}, {len(raw)} bytes"


@contextlib.asynccontextmanager
async def pdfs_read(payload: Any, who: str = ""):
    """Within this block, the inline PDFs of ``payload`` (a request body as bytes or
    str, or its decoded JSON) have been read, off the event loop, in key ``who``'s
    turn; a payload without one costs a substring search."""
    token = _read.set(await read_pdfs(payload, who))
    try:
        yield
    finally:
        _read.reset(token)


async def read_pdfs(payload: Any, who: str = "") -> Optional[dict[str, Optional[str]]]:
    """{data URL: its text or None} for every inline PDF in ``payload``, read in the
    PDF pool when key ``who`` has no other job there; None when there is none (or the
    body is not JSON: its route says so)."""
    if isinstance(payload, (bytes, bytearray, str)):
        marks = ("application/pdf", "application\\/pdf")          # JSON may escape the slash
        if not any((m if isinstance(payload, str) else m.encode()) in payload for m in marks):
            return None
        try:
            payload = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return None
    urls = list(dict.fromkeys(_pdf_urls(payload)))
    if not urls:
        return None
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(PDF_WORKERS, thread_name_prefix="symphony-pdf")
    loop = asyncio.get_running_loop()
    turn = _turns.setdefault(loop, {}).setdefault(who, asyncio.Lock())
    async with turn:
        return await loop.run_in_executor(_pool, _read_all, urls)


def _pdf_urls(obj: Any) -> Iterator[str]:
    """Every string in ``obj`` that is an inline PDF (iteratively: a deep body is no recursion)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            if o.startswith(PDF_URL):
                yield o
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)


def _decoded(url: str) -> tuple[str, bytes]:
    """(media type, bytes) of a ``data:`` URL holding a comma (binascii.Error or ValueError:
    its base64 is not valid)."""
    head, payload = url[5:].split(",", 1)
    raw = base64.b64decode(payload, validate=True) if head.endswith(";base64") else payload.encode()
    return head.split(";")[0] or "text/plain", raw


def _read_all(urls: list[str]) -> dict[str, Optional[str]]:
    out: dict[str, Optional[str]] = {}
    for url in urls:
        try:
            _, raw = _decoded(url)
        except (binascii.Error, ValueError):
            continue                        # inline_text refuses it, naming where it is
        out[url] = pdf_text(raw) if len(raw) <= MAX_PDF_BYTES else None
    return out


MAX_PDF_BYTES = 2 << 20             # a PDF read as text: at most this big ...
MAX_PDF_PAGES = 50                  # ... and its first pages only


def pdf_text(raw: bytes) -> Optional[str]:
    """The text of a PDF (pypdf), at most MAX_PDF_PAGES pages and MAX_INLINE_TEXT
    characters; None for one pypdf cannot read (encrypted, malformed) or without text."""
    try:
        from pypdf import PdfReader
        from pypdf.errors import PdfReadError
        logging.getLogger("pypdf").setLevel(logging.ERROR)      # a malformed file is the client's, not a log line
        try:
            reader = PdfReader(io.BytesIO(raw))
        except PdfReadError:                                    # no usable cross-reference table: rebuild it
            fixed = rebuilt_xref(raw)
            if fixed is None:
                return None
            reader = PdfReader(io.BytesIO(fixed))
        if reader.is_encrypted:
            return None
        out, size = [], 0
        for page in reader.pages[:MAX_PDF_PAGES]:
            text = page.extract_text() or ""
            out.append(text)
            size += len(text)
            if size > MAX_INLINE_TEXT:
                break
        return "\n".join(out).strip()[:MAX_INLINE_TEXT] or None
    except Exception:                                           # noqa: BLE001 - any unreadable PDF is a placeholder
        return None


MAX_PDF_OBJECT = 1 << 18           # a rebuilt table's highest object number (a 2 MiB file holds fewer)


def rebuilt_xref(raw: bytes) -> Optional[bytes]:
    """``raw`` with a cross-reference table built from where its objects are, as readers repair
    a PDF whose table is missing or wrong (hand-written and truncated files): every ``N G obj``
    at its offset, the trailer's ``/Root`` (or the object holding ``/Type /Catalog``); None when no
    catalog is found or an object number is past MAX_PDF_OBJECT.  Each search is one linear scan
    (the input is the client's: no pattern may backtrack across it)."""
    w = rb"[\x00\t\n\x0c\r ]"                                   # PDF white space
    objs: dict[int, tuple[int, int]] = {}
    for m in re.finditer(rb"(?<![0-9])(\d{1,7})" + w + rb"{1,8}(\d{1,5})" + w + rb"{1,8}obj\b", raw):
        objs[int(m.group(1))] = (m.start(), int(m.group(2)))        # a later definition wins
    if not objs or max(objs) > MAX_PDF_OBJECT:
        return None
    root = re.search(rb"/Root" + w + rb"{1,8}(\d{1,7}" + w + rb"{1,8}\d{1,5}" + w + rb"{1,8}R)", raw)
    if root is not None:
        ref = root.group(1)
    else:
        cat = re.search(rb"/Type" + w + rb"{0,8}/Catalog\b", raw)
        held = [(off, num, gen) for num, (off, gen) in objs.items() if cat is not None and off < cat.start()]
        if not held:
            return None
        _, num, gen = max(held)                                      # the object it sits in
        ref = b"%d %d R" % (num, gen)
    body = raw if raw.endswith(b"\n") else raw + b"\n"
    size = max(objs) + 1
    rows = [b"0000000000 65535 f \n"] + [
        (b"%010d %05d n \n" % objs[i]) if i in objs else b"0000000000 65535 f \n" for i in range(1, size)]
    return (body + b"xref\n0 %d\n" % size + b"".join(rows) + b"trailer\n<< /Size %d /Root " % size + ref
            + b" >>\nstartxref\n%d\n%%%%EOF\n" % len(body))
