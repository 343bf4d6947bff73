"""The KVFS namespace: principals, paths, directories, inodes and blocks.

    /                    root  0755
    /shared              root  1777  (sticky: only an entry's owner may remove it)
    /tmp                 root  1777
    /home                root  0755
    /home/<user>         user  0700  (made on the user's first use; only <user> adds entries)

Permission bits are Unix's owner and other bits (no groups): r (4) lets a user
open a file read-only or list a directory, w (2) lets them write a file or add
and remove a directory's entries.  A file's own bits decide who may open it
(directories are not searched for permission).  New files are 0600 and new
directories 0700 unless the caller names a mode; the KVFS umask (default 022)
is cleared from every mode asked for.  The user ``root`` (the kernel itself,
and a Unix-root client that did not act as another user) bypasses every check.
"""
from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass, field
from typing import Optional

from .errors import BadHandle, InvalidArgument, InvalidPath

ROOT_USER = "root"
TOP_DIRS = ("shared", "home", "tmp")
MAX_PATH = 255
MAX_DEPTH = 16
_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
STICKY = 0o1000

ADVICE = ("normal", "keep", "drop_first", "cache")    # and "expire" (with seconds)


@dataclass(frozen=True)
class Principal:
    """Who makes a call: a user name and the process (LIP) id; pid 0 is the kernel."""

    user: str
    pid: int = 0

    def __post_init__(self):
        if not isinstance(self.user, str) or not _USER.fullmatch(self.user):
            raise InvalidArgument(f"bad user name {self.user!r} (lowercase letters, digits, _ and -)")
        if not isinstance(self.pid, int) or self.pid < 0:
            raise InvalidArgument(f"bad pid {self.pid!r}")

    @property
    def is_root(self) -> bool:
        return self.user == ROOT_USER


def split_path(path: str) -> list[str]:
    """Validate an absolute KVFS path and return its components."""
    if not isinstance(path, str):
        raise InvalidPath(f"a path must be a str, got {type(path).__name__}")
    if not path.startswith("/"):
        raise InvalidPath(f"path {path!r} is not absolute")
    if len(path) > MAX_PATH:
        raise InvalidPath(f"path is longer than {MAX_PATH} characters")
    if path == "/":
        return []
    parts = path[1:].split("/")
    if len(parts) > MAX_DEPTH:
        raise InvalidPath(f"path {path!r} is deeper than {MAX_DEPTH} levels")
    for p in parts:
        if not _COMPONENT.fullmatch(p):
            raise InvalidPath(f"path {path!r}: bad component {p!r} (letters, digits, '.', '_', '-'; "
                              "no empty, '.' or '..' components)")
    if parts[0] not in TOP_DIRS:
        raise InvalidPath(f"path {path!r} is outside the namespace (/shared, /home/<user>, /tmp)")
    return parts


class Block:
    """A refcounted page of KV data: K and V of ``page_size`` slots, all layers.

    It lives in exactly one tier: a device page (``device``), a host slot
    (``host``) or a disk slot (``disk``); the others are -1.  Files share
    blocks; ``ref`` counts page-table references and is THE reference count
    of the page (the engine's allocator only knows free from owned: a device
    page is owned by one block, and given back when its ``ref`` drops to 0).
    ``user``/``pid`` are whose quota the block counts against: at first the
    caller whose call made it; ``holders`` counts, per user, the references
    held by that user's files (the kernel's own, a sync copying it out, are
    not anyone's).  When the charged user's last reference goes and other
    users' files still hold the page, the charge moves to one of them
    (`refs.BlockRefs.drop`): no user pays for pages only others use.
    """

    __slots__ = ("id", "ref", "device", "host", "disk", "user", "pid", "holders")
    _ids = itertools.count(1)

    def __init__(self, device: int, user: str, pid: int, holder: Optional[str] = None):
        self.id = next(Block._ids)
        self.ref = 1
        self.device, self.host, self.disk = device, -1, -1
        self.user, self.pid = user, pid
        self.holders = {user if holder is None else holder: 1}

    @property
    def tier(self) -> str:
        return "device" if self.device >= 0 else "host" if self.host >= 0 else "disk"

    def __repr__(self) -> str:
        return f"Block({self.id}, ref={self.ref}, {self.tier})"


class Node:
    def __init__(self, name: str, parent: Optional["Directory"], owner: str, mode: int):
        now = time.time()
        self.name, self.parent, self.owner, self.mode = name, parent, owner, mode
        self.ctime = self.mtime = self.atime = now

    @property
    def path(self) -> Optional[str]:
        if self.parent is None:
            return "/" if isinstance(self, Directory) and self.name == "" else None
        parts, n = [], self
        while n.parent is not None:
            parts.append(n.name)
            n = n.parent
        return "/" + "/".join(reversed(parts))


class Entries(dict):
    """A directory's entries by name; ``version`` counts its changes (so that a
    sorted list of its names is made once per change, not once per listing)."""

    version = 0

    def __setitem__(self, name, node):
        self.version += 1
        super().__setitem__(name, node)

    def __delitem__(self, name):
        self.version += 1
        super().__delitem__(name)

    def pop(self, *args):
        self.version += 1
        return super().pop(*args)


class Directory(Node):
    def __init__(self, name, parent, owner, mode):
        super().__init__(name, parent, owner, mode)
        self.children: Entries = Entries()
        self._sorted = (-1, [])

    def sorted_names(self) -> list:
        """The entries' names in order (a list never changed afterwards: do not change it)."""
        version, names = self._sorted
        if version != self.children.version:
            names = sorted(self.children)
            self._sorted = (self.children.version, names)
        return names


class Inode(Node):
    """A KV file: a block table, each slot's RoPE position, and metadata."""

    _inos = itertools.count(1)

    def __init__(self, owner: str, mode: int, creator_pid: int):
        super().__init__("", None, owner, mode)
        self.ino = next(Inode._inos)
        self.blocks: list[Block] = []
        self.positions: list[int] = []
        self.linked = False          # in the namespace (named and not removed)
        self.handles = 0             # open handles
        self.creator_pid = creator_pid
        self.advice = "normal"
        self.expire_at: Optional[float] = None
        self.durable = False
        self.chain = None            # a chain file's keys (chains.Chain), else None

    @property
    def length(self) -> int:
        return len(self.positions)


@dataclass
class Handle:
    """An open file: the inode, the opening process and the access mode."""

    hid: int
    inode: Inode
    pid: int
    user: str
    writable: bool
    closed: bool = field(default=False)


class Handles(dict):
    """The open handles, by id (a dict of `Handle`), and each process's, so
    that a process's files are found without a walk of all handles.  Written
    only through `add` and `remove`; `of` looks one up for its process."""

    def __init__(self):
        super().__init__()
        self._by_pid: dict[int, dict[int, Handle]] = {}

    def add(self, h: Handle) -> None:
        self[h.hid] = h
        self._by_pid.setdefault(h.pid, {})[h.hid] = h

    def remove(self, h: Handle) -> None:
        del self[h.hid]
        mine = self._by_pid.get(h.pid)
        if mine is not None:
            mine.pop(h.hid, None)
            if not mine:
                del self._by_pid[h.pid]

    def of_pid(self, pid: int) -> list[Handle]:
        """The handles process ``pid`` has open, in the order it opened them."""
        return list(self._by_pid.get(pid, {}).values())

    def count(self, pid: int) -> int:
        return len(self._by_pid.get(pid, ()))

    def open_inodes(self, pids) -> list[Inode]:
        """The files ``pids`` have open, each once, in handle order."""
        return list({h.inode.ino: h.inode for pid in dict.fromkeys(pids)
                     for h in self._by_pid.get(pid, {}).values()}.values())

    def of(self, who: Principal, hid) -> Handle:
        """Handle ``hid`` of ``who``'s process; BadHandle if it is not an int
        or not one of that process's open handles."""
        if not isinstance(hid, int) or isinstance(hid, bool):
            raise BadHandle(f"a KV handle is an int, got {type(hid).__name__}")
        h = self.get(hid)
        if h is None or h.pid != who.pid:
            raise BadHandle(f"no open KV handle {hid} in process {who.pid}")
        return h


def may(principal: Principal, node: Node, want: str) -> bool:
    """Whether ``principal`` has permission ``want`` ('r' or 'w') on ``node``."""
    if principal.is_root:
        return True
    bit = 4 if want == "r" else 2
    shift = 6 if principal.user == node.owner else 0
    return bool(node.mode & (bit << shift))


def may_unlink(principal: Principal, directory: Directory, entry: Node) -> bool:
    """Removing or renaming ``entry`` out of ``directory``: w on the directory,
    and with the sticky bit, ownership of the entry or of the directory."""
    if not may(principal, directory, "w"):
        return False
    if directory.mode & STICKY and not principal.is_root:
        return principal.user in (entry.owner, directory.owner)
    return True


def list_entry(name: str, child: Node) -> dict:
    """One entry of a listing: name, type, owner, mode (a file's length and pages too)."""
    e = {"name": name, "type": "dir" if isinstance(child, Directory) else "file",
         "owner": child.owner, "mode": child.mode}
    if isinstance(child, Inode):
        e.update(length=child.length, pages=len(child.blocks))
    return e


def is_home_dir(path: str) -> bool:
    """/home/<user> (the top directories are refused earlier, by _parent_of)."""
    parts = split_path(path)
    return len(parts) == 2 and parts[0] == "home"


def system_entry(path: str) -> InvalidPath:
    return InvalidPath(f"{path!r} names a system directory, not an entry that can be made or removed")
