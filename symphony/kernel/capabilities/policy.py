"""The administrator's capability policy and the check of a client's grants.

A client asks for grants at spawn (``symphony run --grant read:DIR --grant
http:HOST[:PORT]``); the kernel accepts them only inside the administrator's
policy (``symphony-kernel --allow-read/--deny-read/--allow-http``):

    read:DIR   DIR must be an existing directory the submitting user can reach,
               under an --allow-read root (default: /) and not under a denied
               path.  Built-in denials that no flag lifts: /proc, /sys, /dev
               (with /dev/shm), /run and the kernel's own directories.
    http:HOST  HOST[:PORT] must match an --allow-http entry (default: any);
               entries are HOST, HOST:PORT or *.DOMAIN.

Every file a LIP later opens is checked again by its resolved real path (see
files.py), so symlinks and renames cannot lead outside the grant or into a
denied path.
"""
from __future__ import annotations

import fnmatch
import os
import re
import stat
import tempfile
import urllib.parse
from dataclasses import dataclass, field
from typing import Iterable, Optional

from symphony.kernel.failure import SyscallFailure
from symphony.kernel.capabilities.identity import Credentials, Identity

BUILTIN_DENY = ("/proc", "/sys", "/dev", "/run")
MAX_GRANTS = 64
_HOST_RE = re.compile(r"(\*\.)?[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]")


CapError = SyscallFailure        # a capability call failed: the syscall layer's one error type


@dataclass(frozen=True)
class HttpGrant:
    """One http grant: a host (lower case, IPv6 without brackets) and an optional port."""
    host: str
    port: Optional[int]

    def matches(self, host: str, port: int) -> bool:
        return self.host == host and self.port in (None, port)

    def __str__(self):
        h = f"[{self.host}]" if ":" in self.host else self.host
        return h if self.port is None else f"{h}:{self.port}"


def parse_host(spec: str, what: str = "http grant") -> HttpGrant:
    """'host', 'host:port', '[v6]:port' or '*.domain' -> HttpGrant (ValueError if malformed)."""
    if not isinstance(spec, str) or not 0 < len(spec) <= 261:
        raise ValueError(f"bad {what} {spec!r}: host or host:port")
    try:
        u = urllib.parse.urlsplit("//" + spec)
        host, port = u.hostname, u.port
    except ValueError:
        raise ValueError(f"bad {what} {spec!r}: host or host:port") from None
    netloc_host = u.netloc.rsplit(":", 1)[0] if port is not None else u.netloc
    if not host or u.path or u.query or u.fragment or "@" in u.netloc or not _HOST_RE.fullmatch(netloc_host):
        raise ValueError(f"bad {what} {spec!r}: host or host:port")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"bad {what} {spec!r}: port out of range")
    return HttpGrant(host.lower(), port)


@dataclass(frozen=True)
class CapPolicy:
    """The validated policy; build it with ``CapPolicy.build``, pass it into the kernel.

    ``allow_read``: real paths under which read grants may be given (None = anywhere);
    ``deny_read``: real paths no capability may open, built-ins included;
    ``deny_globs``: fnmatch patterns of denied files (the kernel's temporary files);
    ``allow_http``: admitted hosts (None = any); ``workers``/``per_lip``/``per_user``: the
    pool, one LIP's share of it and one user's; ``timeout_s``: the longest a call may take."""
    allow_read: Optional[tuple] = None
    deny_read: tuple = BUILTIN_DENY
    deny_globs: tuple = ()
    allow_http: Optional[tuple] = None
    workers: int = 4
    per_lip: int = 2
    timeout_s: float = 30.0
    per_user: int = 2
    creds: Credentials = field(default_factory=Credentials, compare=False, repr=False)

    @classmethod
    def build(cls, allow_read: Optional[Iterable[str]] = None, deny_read: Iterable[str] = (),
              allow_http: Optional[Iterable[str]] = None, kernel_dirs: Iterable[Optional[str]] = (),
              socket_path: Optional[str] = None, workers: int = 4, per_lip: int = 2, timeout_s: float = 30.0,
              per_user: Optional[int] = None) -> "CapPolicy":
        """Validate the administrator's settings (ValueError on a bad one).

        ``allow_read``/``allow_http`` None mean any (the user's own permissions
        still apply to files); the word "none" in either means no such grant.
        ``kernel_dirs``: the kernel's own directories (durable and swap dirs,
        build cache), denied too, as is the directory of ``socket_path`` --
        unless that is a shared sticky directory such as /tmp: then only the
        socket itself."""
        def absdirs(paths, flag):
            out = []
            for p in paths:
                if not isinstance(p, str) or not os.path.isabs(p):
                    raise ValueError(f"{flag} {p!r}: an absolute path is needed")
                out.append(os.path.realpath(p))
            return out
        allow = None
        if allow_read is not None:
            allow_read = list(allow_read)
            allow = () if allow_read == ["none"] else tuple(absdirs(allow_read, "--allow-read"))
        deny = list(BUILTIN_DENY) + absdirs(list(deny_read), "--deny-read")
        deny += [os.path.realpath(p) for p in kernel_dirs if p]
        if socket_path:
            sock = os.path.realpath(socket_path)
            deny.append(sock if _shared_dir(os.path.dirname(sock)) else os.path.dirname(sock))
        tmp = os.path.realpath(tempfile.gettempdir())
        globs = (os.path.join(tmp, "symphony-tok-*"),)
        http = None
        if allow_http is not None:
            allow_http = list(allow_http)
            http = () if allow_http == ["none"] else tuple(parse_host(h, "--allow-http entry") for h in allow_http)
        per_user = max(1, workers // 2) if per_user is None else per_user
        for n, name, lo, hi in ((workers, "--cap-workers", 1, 256), (per_lip, "--cap-share", 1, 256),
                                (per_user, "--cap-share-user", 1, 256)):
            if not isinstance(n, int) or isinstance(n, bool) or not lo <= n <= hi:
                raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {n!r}")
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not 0.1 <= timeout_s <= 3600:
            raise ValueError(f"--cap-timeout must be in [0.1, 3600] seconds, got {timeout_s!r}")
        return cls(allow, tuple(dict.fromkeys(deny)), globs, http, workers, per_lip, float(timeout_s), per_user)

    # ------------------------------------------------------------------ checks
    def denied(self, real: str) -> Optional[str]:
        """The denied path (or pattern) that covers the real path ``real``, or None."""
        for d in self.deny_read:
            if _under(real, d):
                return d
        for g in self.deny_globs:
            if fnmatch.fnmatchcase(real, g):
                return g
        return None

    def check_grants(self, g, who: Optional[Identity]) -> dict:
        """A client's grants, checked against the policy as user ``who``; returns
        {"http": [host[:port] ...], "read": [real dirs ...]} or raises ValueError."""
        if g is None:
            g = {}
        if not isinstance(g, dict) or set(g) - {"http", "read"}:
            raise ValueError("grants must be {'http': [hosts], 'read': [dirs]}")
        http, read = g.get("http") or [], g.get("read") or []
        if not isinstance(http, list) or not isinstance(read, list):
            raise ValueError("grants must be {'http': [hosts], 'read': [dirs]}")
        if len(http) > MAX_GRANTS or len(read) > MAX_GRANTS:
            raise ValueError(f"at most {MAX_GRANTS} grants of each kind")
        hosts = []
        for h in http:
            hg = parse_host(h)
            if hg.host.startswith("*."):
                raise ValueError(f"http grant {h!r}: name one host, not a pattern")
            if not self.http_allowed(hg):
                raise PermissionError(f"http grant {h!r} is not allowed by the kernel's policy "
                                      f"(allowed: {', '.join(map(str, self.allow_http)) or 'none'})")
            hosts.append(str(hg))
        dirs = []
        for d in read:
            if not isinstance(d, str) or not os.path.isabs(d) or "\0" in d or len(d) > 4096:
                raise ValueError(f"read grant {d!r} is not an absolute directory path")
            real = self._reach_dir(d, who)
            if self.allow_read is not None and not any(_under(real, a) for a in self.allow_read):
                raise PermissionError(f"read grant {d!r} is outside the kernel's allowed roots "
                                      f"({', '.join(self.allow_read) or 'none'})")
            bad = self.denied(real)
            if bad:
                raise PermissionError(f"read grant {d!r} is forbidden by the kernel's policy "
                                      f"({real} is under denied {bad})")
            dirs.append(real)
        return {"http": hosts, "read": list(dict.fromkeys(dirs))}

    def http_allowed(self, g: HttpGrant) -> bool:
        if self.allow_http is None:
            return True
        for a in self.allow_http:
            host_ok = a.host == g.host or (a.host.startswith("*.") and g.host.endswith(a.host[1:]))
            if host_ok and (a.port is None or a.port == g.port):
                return True
        return False

    def _reach_dir(self, d: str, who: Optional[Identity]) -> str:
        """The real path of directory ``d`` as ``who`` reaches it (ValueError if they cannot)."""
        with self.creds.as_user(who):
            try:
                fd = os.open(os.path.join(d, "."), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)   # "/.": search right
            except OSError as e:
                raise ValueError(f"read grant {d!r} is not a directory you can reach "
                                 f"({os.strerror(e.errno)})") from None
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)


def _under(path: str, root: str) -> bool:
    return path == root or root == "/" or path.startswith(root.rstrip("/") + "/")


def _shared_dir(d: str) -> bool:
    """A world-writable sticky directory (/tmp): never deny it whole."""
    try:
        m = os.stat(d).st_mode
    except OSError:
        return True
    return bool(m & stat.S_ISVTX) and bool(m & 0o002)
