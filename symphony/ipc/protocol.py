"""Framing of the program RPC on the kernel's Unix socket: each message is a
4-byte big-endian length and that many bytes of JSON (orjson).  Frames over
`MAX_FRAME` bytes are refused (the connection is closed)."""
from __future__ import annotations

import asyncio
import os
import socket
import struct

import orjson

MAX_FRAME = 16 << 20


def default_socket_path() -> str:
    """$SYMPHONY_SOCKET, else $XDG_RUNTIME_DIR/symphony.sock, else /tmp/symphony-UID.sock."""
    env = os.environ.get("SYMPHONY_SOCKET")
    if env:
        return env
    run = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(run, "symphony.sock") if run else f"/tmp/symphony-{os.getuid()}.sock"


class ProtocolError(Exception):
    pass


async def read_frame(reader: asyncio.StreamReader):
    head = await reader.readexactly(4)
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    msg = orjson.loads(await reader.readexactly(n))
    if not isinstance(msg, dict):
        raise ProtocolError("a frame must hold a JSON object")
    return msg


def encode_frame(obj) -> bytes:
    data = orjson.dumps(obj)
    return struct.pack(">I", len(data)) + data


def send_frame_sync(sock: socket.socket, obj) -> None:
    sock.sendall(encode_frame(obj))


def recv_frame_sync(sock: socket.socket):
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    if len(head) < 4:
        raise ProtocolError("connection closed inside a frame header")
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    body = _recv_exact(sock, n)
    if body is None or len(body) < n:
        raise ProtocolError("connection closed inside a frame")
    return orjson.loads(body)


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None if not buf else bytes(buf)
        buf += chunk
    return bytes(buf)
