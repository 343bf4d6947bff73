"""API keys: who an HTTP client is, and what it may ask for.

A key file is JSON, written by ``symphony keys add|rm`` (mode 0600):

    {"version": 1, "keys": [{"name": "ci", "sha256": "<hex of the key's SHA-256>",
      "user": "alice", "max_priority": "normal", "grants": {"http": [...], "read": [...]},
      "rpm": 600, "max_concurrent": 16, "share_cache": false, "created": "2026-11-25T21:00:00Z"}]}

Only the SHA-256 of a key is stored (a key is 256 random bits, so a plain
hash is as strong as a slow one); a presented key is hashed and compared with
every stored hash in constant time (`hmac.compare_digest`, no early exit).
The key itself is printed once by ``keys add`` and never again.

Each key maps to a KVFS user (never root), the highest scheduling class its
LIPs may ask for, the capability grants they may ask for (a subset; the
kernel's own policy still applies on top), its request rate (requests per
minute) and how many requests or LIPs it may have running at once, and
whether its requests may share prefix-cache files with other keys that do.

The gateway reads the file at start-up and again on SIGHUP (`KeyStore.reload`).
A gateway started as root by ``symphony-kernel --http`` drops its privileges
after reading it; it keeps the file open so that a reload reads the same file
(``symphony keys`` rewrites it in place under a lock).
"""
from __future__ import annotations

import fcntl
import hashlib
import hmac
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Optional

import orjson

PRIORITIES = ("batch", "normal", "interactive")
_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
KEY_PREFIX = "sym-"
MAX_KEY_FILE = 16 << 20


class KeyFileError(ValueError):
    """The key file cannot be read or holds a malformed entry."""


def default_key_file() -> str:
    """$SYMPHONY_KEYS, else /etc/symphony/keys.json for root, else ~/.config/symphony/keys.json."""
    env = os.environ.get("SYMPHONY_KEYS")
    if env:
        return env
    if os.geteuid() == 0:
        return "/etc/symphony/keys.json"
    return os.path.expanduser("~/.config/symphony/keys.json")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class KeyPolicy:
    """What one key may do (see the module docstring)."""
    name: str
    user: str
    sha256: str = ""
    max_priority: str = "normal"
    grants: dict = field(default_factory=lambda: {"http": [], "read": []})
    rpm: int = 600
    max_concurrent: int = 16
    share_cache: bool = False
    created: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise KeyFileError(f"key name {self.name!r}: 1-64 letters, digits, '.', '_' or '-'")
        if not isinstance(self.user, str) or not _USER_RE.fullmatch(self.user) or self.user == "root":
            raise KeyFileError(f"key {self.name!r}: user {self.user!r} must be a KVFS user name "
                               f"([a-z_][a-z0-9_-]*, at most 32 characters) and not root")
        if self.max_priority not in PRIORITIES:
            raise KeyFileError(f"key {self.name!r}: max_priority must be one of {', '.join(PRIORITIES)}")
        g = self.grants
        if not (isinstance(g, dict) and set(g) <= {"http", "read"}
                and all(isinstance(v, list) and all(isinstance(x, str) and x for x in v) for v in g.values())):
            raise KeyFileError(f"key {self.name!r}: grants must be {{\"http\": [HOST...], \"read\": [DIR...]}}")
        for what, v, lo in (("rpm", self.rpm, 1), ("max_concurrent", self.max_concurrent, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= 1_000_000:
                raise KeyFileError(f"key {self.name!r}: {what} must be an int in [{lo}, 1000000]")
        if not isinstance(self.share_cache, bool):
            raise KeyFileError(f"key {self.name!r}: share_cache must be true or false")

    def allows_priority(self, asked: str) -> bool:
        return PRIORITIES.index(asked) <= PRIORITIES.index(self.max_priority)

    def allows_grants(self, asked: dict) -> Optional[str]:
        """None if every grant asked for is one this key may give, else what is not."""
        for kind, values in asked.items():
            allowed = self.grants.get(kind, [])
            for v in values:
                if kind == "read":
                    if not any(v == a or v.startswith(a.rstrip("/") + "/") for a in allowed):
                        return f"read:{v}"
                elif v not in allowed and v.split(":")[0] not in allowed:
                    return f"http:{v}"
        return None

    def as_json(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "user": self.user, "max_priority": self.max_priority,
                "grants": self.grants, "rpm": self.rpm, "max_concurrent": self.max_concurrent,
                "share_cache": self.share_cache, "created": self.created}


def _parse(data: bytes, path: str) -> list[KeyPolicy]:
    if not data.strip():
        return []
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise KeyFileError(f"{path}: not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys", []), list):
        raise KeyFileError(f"{path}: expected {{\"version\": 1, \"keys\": [...]}}")
    out, names = [], set()
    for e in doc.get("keys", []):
        if not isinstance(e, dict) or not isinstance(e.get("sha256"), str) or \
                not re.fullmatch(r"[0-9a-f]{64}", e["sha256"]):
            raise KeyFileError(f"{path}: an entry without a valid sha256: {str(e)[:80]!r}")
        known = {k: e[k] for k in ("name", "user", "sha256", "max_priority", "grants", "rpm",
                                   "max_concurrent", "share_cache", "created") if k in e}
        try:
            k = KeyPolicy(**known)
        except TypeError as err:
            raise KeyFileError(f"{path}: malformed entry: {err}") from None
        if k.name in names:
            raise KeyFileError(f"{path}: two keys named {k.name!r}")
        names.add(k.name)
        out.append(k)
    return out


class KeyStore:
    """The keys the gateway accepts (read from ``path``; reloaded by `reload`)."""

    def __init__(self, path: Optional[str]):
        self.path = path
        self.keys: list[KeyPolicy] = []
        self._fd: Optional[int] = None
        if path is not None and os.path.exists(path):
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.reload()

    @property
    def configured(self) -> bool:
        return bool(self.keys)

    def reload(self) -> int:
        """Read the key file again (by its path if this process may, else through
        the descriptor kept from start-up); returns the number of keys.  On a
        malformed file the keys in force stay and KeyFileError is raised."""
        if self.path is None:
            return 0
        fd, own = self._fd, False
        try:
            fd, own = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC), True
        except FileNotFoundError:
            if fd is None:
                self.keys = []
                return 0
        except PermissionError:
            if fd is None:
                raise KeyFileError(f"{self.path}: permission denied") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                os.lseek(fd, 0, os.SEEK_SET)
                data = _read_all(fd, self.path)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            if own:
                if self._fd is not None:
                    os.close(self._fd)
                self._fd = fd
        self.keys = _parse(data, self.path)
        return len(self.keys)

    def lookup(self, presented: Optional[str]) -> Optional[KeyPolicy]:
        """The policy of the key ``presented`` (None if it matches none); every
        stored hash is compared, in constant time each."""
        if not presented or not isinstance(presented, str) or len(presented) > 512:
            return None
        digest = hash_key(presented)
        found = None
        for k in self.keys:
            if hmac.compare_digest(k.sha256, digest):
                found = k
        return found


def _read_all(fd: int, path: str) -> bytes:
    chunks, size = [], 0
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            return b"".join(chunks)
        size += len(b)
        if size > MAX_KEY_FILE:
            raise KeyFileError(f"{path}: larger than {MAX_KEY_FILE >> 20} MiB")
        chunks.append(b)


# ---------------------------------------------------------------- `symphony keys`
def _rewrite(path: str, edit) -> list[KeyPolicy]:
    """Apply ``edit(keys) -> keys`` to the key file in place, under an exclusive
    lock (a gateway that keeps the file open reads the new content on SIGHUP)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.fchmod(fd, 0o600)
        keys = edit(_parse(_read_all(fd, path), path))
        data = orjson.dumps({"version": 1, "keys": [k.as_json() for k in keys]}, option=orjson.OPT_INDENT_2)
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, data + b"\n")
        os.fsync(fd)
        return keys
    finally:
        os.close(fd)


def add_key(path: str, name: str, user: str, **policy) -> tuple[str, KeyPolicy]:
    """Make a new key ``name`` for ``user``; returns (the key, its policy).  The
    key is not stored, only its hash: show it once."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    entry = KeyPolicy(name=name, user=user, sha256=hash_key(key),
                      created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **policy)

    def edit(keys):
        if any(k.name == name for k in keys):
            raise KeyFileError(f"a key named {name!r} exists already (symphony keys rm {name} first)")
        return keys + [entry]
    _rewrite(path, edit)
    return key, entry


def remove_key(path: str, name: str) -> None:
    def edit(keys):
        if not any(k.name == name for k in keys):
            raise KeyFileError(f"no key named {name!r} in {path}")
        return [k for k in keys if k.name != name]
    _rewrite(path, edit)


def list_keys(path: str) -> list[KeyPolicy]:
    return KeyStore(path).keys if os.path.exists(path) else []
