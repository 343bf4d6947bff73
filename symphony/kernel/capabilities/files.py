"""read_file and list_dir: opened as the submitting user, checked by real path.

One call, on a capability worker thread:

    1. switch the thread's file credentials to the LIP's owner (identity.py)
    2. open(path, O_PATH)          walks the path with the user's search rights;
                                   O_PATH never blocks and has no side effects
    3. fstat + fstatfs             only regular files (read) or directories
                                   (list); FIFOs, sockets, devices and files on
                                   proc/sys/FUSE-like file systems are refused
    4. readlink(/proc/self/fd/N)   the real path of what was opened: it must lie
                                   under a granted directory and under no denied
                                   path (symlinks and renames cannot escape)
    5. open(/proc/self/fd/N, O_RDONLY|O_NONBLOCK|O_NOCTTY)
                                   re-opens that very inode, with the user's
                                   read permission checked
    6. restore the thread's credentials
"""
from __future__ import annotations

import ctypes
import errno
import os
import stat
from typing import Optional

from symphony.kernel.capabilities.identity import Identity
from symphony.kernel.failure import fail
from symphony.kernel.capabilities.policy import CapPolicy

MAX_ENTRIES = 10000
_SCAN_LIMIT = 100000
# file systems whose files are not data, or whose reads another user's process can stall
_BAD_FS = {0x9fa0: "proc", 0x62656572: "sysfs", 0x65735546: "fuse", 0x64626720: "debugfs",
           0x74726163: "tracefs", 0x73636673: "securityfs", 0x27e0eb: "cgroup", 0x63677270: "cgroup2",
           0xcafe4a11: "bpf", 0x1cd1: "devpts", 0x42494e4d: "binfmt_misc", 0x6e736673: "nsfs"}
_libc = ctypes.CDLL(None, use_errno=True)


def read_file(policy: CapPolicy, who: Optional[Identity], grants: dict, body: dict,
              max_bytes_limit: int) -> dict:
    """{"path", "max_bytes"} -> {"data": text} (undecodable bytes replaced)."""
    path = _path_arg(body)
    n = body.get("max_bytes", max_bytes_limit)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_bytes_limit:
        fail("InvalidArgument", "EINVAL", f"max_bytes must be an int in [1, {max_bytes_limit}], got {n!r}")
    fd = _open(policy, who, grants, path, want_dir=False)
    try:
        chunks, left = [], n
        while left > 0:
            b = os.read(fd, min(left, 1 << 16))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
    except BlockingIOError:
        fail("CapabilityError", "EAGAIN", f"{path}: reading it would block")
    except OSError as e:
        fail("CapabilityError", "EIO", f"{path}: read failed: {os.strerror(e.errno)}")
    finally:
        os.close(fd)
    return {"data": b"".join(chunks).decode("utf-8", "replace")}


def list_dir(policy: CapPolicy, who: Optional[Identity], grants: dict, body: dict) -> dict:
    """{"path"} -> {"entries": sorted names, directories with a trailing '/'} (at most 10000)."""
    path = _path_arg(body)
    fd = _open(policy, who, grants, path, want_dir=True)
    names = []
    try:
        with os.scandir(fd) as it:
            for e in it:
                try:
                    d = e.is_dir(follow_symlinks=False)
                except OSError:
                    d = False
                names.append(e.name + ("/" if d else ""))
                if len(names) >= _SCAN_LIMIT:
                    break
    except OSError as e:
        fail("CapabilityError", "EIO", f"{path}: listing failed: {os.strerror(e.errno)}")
    finally:
        os.close(fd)
    return {"entries": sorted(names)[:MAX_ENTRIES]}


# ---------------------------------------------------------------- helpers
def _path_arg(body: dict) -> str:
    p = body.get("path")
    if not isinstance(p, str) or not p or "\0" in p or len(p) > 4096:
        fail("InvalidArgument", "EINVAL", "path must be a non-empty string of at most 4096 characters")
    if not os.path.isabs(p):
        fail("InvalidArgument", "EINVAL", f"path must be absolute, got {p[:200]!r}")
    return p


def _open(policy: CapPolicy, who, grants: dict, path: str, want_dir: bool) -> int:
    """Steps 1-6 of the module docstring; returns a readable fd the caller closes."""
    roots = grants.get("read") or []
    shown = path[:300]
    if not roots:
        fail("PermissionDenied", "EACCES", "no directory is granted to this LIP (--grant read:DIR)")
    with policy.creds.as_user(who):
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError as e:
            _os_fail(e, shown)
        try:
            st = os.fstat(pfd)
            real = os.readlink(f"/proc/self/fd/{pfd}")
            if not any(real == r or r == "/" or real.startswith(r.rstrip("/") + "/") for r in roots):
                fail("PermissionDenied", "EACCES", f"{shown} is not under a directory granted to this "
                     f"LIP (granted: {', '.join(roots)})")
            bad = policy.denied(real)
            if bad:
                fail("PermissionDenied", "EACCES", f"{shown} is forbidden by the kernel's policy "
                     f"(under {bad})")
            if stat.S_ISDIR(st.st_mode) and not want_dir:
                fail("IsADirectory", "EISDIR", f"{shown} is a directory")
            if want_dir and not stat.S_ISDIR(st.st_mode):
                fail("NotADirectory", "ENOTDIR", f"{shown} is not a directory")
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                fail("PermissionDenied", "EACCES", f"{shown} is a {_kind(st.st_mode)}: only regular "
                     "files and directories may be read")
            fs = _fs_type(pfd)
            if fs in _BAD_FS:
                fail("PermissionDenied", "EACCES", f"{shown} is on a {_BAD_FS[fs]} file system, "
                     "which capabilities do not read")
            flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (os.O_DIRECTORY if want_dir else 0)
            try:
                return os.open(f"/proc/self/fd/{pfd}", flags)
            except OSError as e:
                _os_fail(e, shown)
        finally:
            os.close(pfd)


def _os_fail(e: OSError, shown: str):
    if e.errno == errno.ENOENT:
        fail("NotFound", "ENOENT", f"{shown} does not exist")
    if e.errno == errno.ENOTDIR:
        fail("NotADirectory", "ENOTDIR", f"{shown}: a component of the path is not a directory")
    if e.errno in (errno.EACCES, errno.EPERM):
        fail("PermissionDenied", "EACCES", f"{shown}: permission denied (files are read with the "
             "permissions of the user who ran the LIP)")
    if e.errno == errno.ELOOP:
        fail("InvalidPath", "ELOOP", f"{shown}: too many levels of symbolic links")
    fail("CapabilityError", "EIO", f"{shown}: {os.strerror(e.errno or errno.EIO)}")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


class _StatFs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_long * 15)]


def _fs_type(fd: int) -> int:
    buf = _StatFs()
    if _libc.fstatfs(fd, ctypes.byref(buf)) != 0:
        return 0
    return buf.f_type & 0xFFFFFFFF
