"""Whose permissions a file capability runs with.

A LIP's file capabilities open files as the Unix user who submitted it, never as
the kernel.  A root kernel switches the *calling thread's* file-system
credentials (fsuid, fsgid, supplementary groups) around each path walk: Linux
keeps credentials per thread, and the raw system calls change only the caller
(glibc's setgroups() would broadcast to every thread of the kernel, so it is not
used).  Switching fsuid away from 0 also drops CAP_DAC_OVERRIDE and friends from
the thread's effective set; switching back restores them.  A kernel that is not
root reads as itself (it can only run its own user's LIPs).
"""
from __future__ import annotations

import ctypes
import os
import platform
import pwd
from contextlib import contextmanager
from typing import Iterator, NamedTuple, Optional

# raw system call numbers: (setfsuid, setfsgid, setgroups)
_NR = {"x86_64": (122, 123, 116), "aarch64": (151, 152, 159)}
_NOBODY = 65534


class Identity(NamedTuple):
    """A Unix identity to check file permissions with."""
    uid: int
    gid: int
    groups: tuple = ()


def nobody() -> Identity:
    try:
        p = pwd.getpwnam("nobody")
        return Identity(p.pw_uid, p.pw_gid, ())
    except KeyError:
        return Identity(_NOBODY, _NOBODY, ())


def identity_for(peer_uid: int, user: str, acting: bool, on_behalf: bool = False) -> Identity:
    """The identity a LIP's file capabilities use.

    ``peer_uid`` is the client's Unix uid (SO_PEERCRED); ``acting`` is true when
    root named another user (``--as-user``), ``on_behalf`` when the trusted
    gateway did: that user's passwd entry if it has one, else ``nobody``.  A
    uid without a passwd entry gets no group rights (nobody's group): we do not
    know its groups, so we grant none."""
    name = None
    if (peer_uid == 0 and acting) or on_behalf:
        try:
            p = pwd.getpwnam(user)
        except KeyError:
            return nobody()
        uid, gid, name = p.pw_uid, p.pw_gid, p.pw_name
    else:
        uid = peer_uid
        try:
            p = pwd.getpwuid(uid)
            gid, name = p.pw_gid, p.pw_name
        except KeyError:
            gid = nobody().gid
    groups = tuple(sorted(set(os.getgrouplist(name, gid)))) if name else ()
    return Identity(uid, gid, groups)


class Credentials:
    """Switches the calling thread's file-system credentials (root kernels only)."""

    def __init__(self):
        self.enabled = os.geteuid() == 0
        self.nr = _NR.get(platform.machine())
        if self.enabled and self.nr is None:
            raise RuntimeError(f"file capabilities: per-thread credentials are not supported on "
                               f"{platform.machine()} (x86_64 and aarch64 are)")
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        self.home = Identity(os.geteuid(), os.getegid(), tuple(os.getgroups()))

    @contextmanager
    def as_user(self, who: Optional[Identity]) -> Iterator[None]:
        """Run the body with ``who``'s file permissions (a no-op when not root or
        when ``who`` is None on a non-root kernel)."""
        if not self.enabled:
            yield
            return
        who = who or nobody()
        try:
            self._set(who)
            yield
        finally:
            self._set(self.home)

    def _set(self, who: Identity) -> None:
        nr_uid, nr_gid, nr_groups = self.nr
        sc = self._libc.syscall
        if who.uid != 0:                      # still privileged: change groups and gid first
            self._groups(who.groups)
            sc(nr_gid, ctypes.c_uint(who.gid))
            sc(nr_uid, ctypes.c_uint(who.uid))
        else:
            sc(nr_uid, ctypes.c_uint(0))      # back to fsuid 0 first: regains CAP_SETGID's use
            sc(nr_gid, ctypes.c_uint(who.gid))
            self._groups(who.groups)
        # setfsuid/setfsgid return the previous value and report no error: check by asking again
        if sc(nr_uid, ctypes.c_uint(who.uid)) != who.uid or sc(nr_gid, ctypes.c_uint(who.gid)) != who.gid:
            raise PermissionError(f"could not switch file credentials to {who.uid}:{who.gid}")

    def _groups(self, groups: tuple) -> None:
        arr = (ctypes.c_uint * max(1, len(groups)))(*groups)
        if self._libc.syscall(self.nr[2], ctypes.c_size_t(len(groups)), arr) != 0:
            e = ctypes.get_errno()
            raise PermissionError(e, f"setgroups failed: {os.strerror(e)}")
