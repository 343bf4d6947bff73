"""KVFS: the KV cache as a file system, inside the kernel's engine.

    fs = KVFS(engine, KVFSConfig(host_pages=4096, swap_dir="/var/tmp/symphony"))
    alice = Principal("alice", pid=7)
    h = fs.create(alice, "/home/alice/sys.kv")          # read-write handle (an int)
    fs.pred(alice, h, tokens)                           # append tokens, get logits
    c = fs.fork(alice, h)                               # anonymous copy-on-write clone
    fs.close(alice, h)

Every call names its caller (`Principal`: user + pid).  Handles are ints that
only their own process may use.  Errors are the typed `KVFSError` subclasses
of `errors.py`, raised before anything changes.

KVFS is the namespace (directories, files, handles) and holds its parts, each
given its collaborators: ``data`` (`data.Data`: pred's prepare/commit, fork,
truncate, extract, merge), ``memory`` (`memory.Memory`: the eviction order,
reclaim, suspension), ``pager`` (`pager.Pager`: tier moves), ``quotas`` and
``refs``; durable files are `store`'s.  The methods of the parts that make
KVFS's API are called through KVFS (``fs.fork``, ``fs.reclaim``, ...).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

from symphony.engine.engine import Engine
from .config import KVFSConfig
from .chains import Chains
from .data import Data, KVPred, StepPlan
from .errors import (AlreadyExists, DirectoryNotEmpty, InvalidArgument, IsADirectory,
                     NotADirectory, NotFound, PermissionDenied)
from .namespace import (ADVICE, ROOT_USER, STICKY, Directory, Handle, Handles, Inode, Node, Principal,
                        is_home_dir as _is_home_dir, list_entry, may, may_unlink, split_path,
                        system_entry as _system_entry)
from .memory import Memory
from .pager import Pager
from .quota import Quotas
from .refs import BlockRefs

log = logging.getLogger("symphony.kvfs")

KERNEL = Principal(ROOT_USER, 0)


class KVFS:
    def __init__(self, engine: Engine, config: KVFSConfig = KVFSConfig(), *, restore: bool = True,
                 evict_first: Optional[Callable[[], list[int]]] = None,
                 pinned: Optional[Callable[[], set[int]]] = None):
        """``evict_first() -> [pid]``: processes whose files leave the device
        first (blocked LIPs); ``pinned() -> {pid}``: processes whose open files
        are never page-evicted (running LIPs).  Both are the kernel's; see
        `memory.Memory` for who loses what under pressure."""
        self.engine, self.config = engine, config
        self.page_size = engine.page_size
        self.pager = Pager(engine.kv, config.host_pages,
                           Path(config.swap_dir) if config.swap_dir else None, config.disk_pages)
        for name in ("default_file_mode", "default_dir_mode", "umask"):
            v = getattr(config, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 0o777:
                raise ValueError(f"KVFSConfig.{name} must be an int in 0..0o777, got {v!r}")
        self.quotas = Quotas(config.user_page_quota, config.process_page_quota, config.per_user_quota,
                             config.user_inode_quota, config.user_ref_quota)
        self.refs = BlockRefs(self.pager, self.quotas, engine.kv.allocator)   # references and charges of pages
        self.root = Directory("", None, ROOT_USER, 0o755)
        for name, mode in (("shared", 0o1777), ("home", 0o755), ("tmp", 0o1777)):
            self.root.children[name] = Directory(name, self.root, ROOT_USER, mode)
        self.handles = Handles()
        self._hids = itertools.count(3)
        self.inodes: dict[int, Inode] = {}
        self._expiry: list[tuple[float, int]] = []       # heap of (expire_at, ino)
        self.evict_first: Callable[[], list[int]] = evict_first or (lambda: [])   # pids to swap out first
        self.pinned: Callable[[], set[int]] = pinned or (lambda: set())          # pids never page-evicted
        unlink = lambda inode: self._unlink(inode.parent, inode.name)    # noqa: E731
        self.memory = Memory(self.pager, self.quotas, self.handles, unlink, self.evict_first, self.pinned)
        self.data = Data(self, self.memory)
        self.chains = Chains(self, unlink)                  # block-keyed prefix files (chains.py)
        if restore and config.durable_dir:
            from .store import restore_all
            self.restore_report = restore_all(self)
        else:
            self.restore_report = None

    # ================================================================== namespace
    def create(self, who: Principal, path: Optional[str] = None, mode: Optional[int] = None) -> int:
        """A new empty file, opened read-write.  No path: anonymous, freed when
        its handles close (and with its creating process).  Its mode is ``mode``
        (default ``config.default_file_mode``, 0600) less ``config.umask``."""
        self._tick()
        mode = self._new_mode(mode, self.config.default_file_mode)
        inode = Inode(who.user, mode, who.pid)
        if path is not None:
            parent, name = self._parent_for_create(who, path)
            self._link(parent, name, inode)
        self.inodes[inode.ino] = inode
        self.memory.touch(inode)
        return self._new_handle(who, inode, writable=True)

    def open(self, who: Principal, path: str, mode: str = "r") -> int:
        """Open a named file, ``mode`` 'r' (read-only) or 'rw'."""
        self._tick()
        if mode not in ("r", "rw"):
            raise InvalidArgument(f"open mode must be 'r' or 'rw', got {mode!r}")
        node = self._lookup(path)
        if isinstance(node, Directory):
            raise IsADirectory(f"{path} is a directory")
        if not may(who, node, "r") or (mode == "rw" and not may(who, node, "w")):
            raise PermissionDenied(f"{who.user} may not open {path} for {'writing' if mode == 'rw' else 'reading'}")
        node.atime = time.time()
        if node.advice == "cache":
            self.memory.touch(node)                         # a cache file is used when it is opened
        return self._new_handle(who, node, writable=(mode == "rw"))

    def close(self, who: Principal, hid: int) -> None:
        h = self._handle(who, hid)
        self._forget_handle(h)
        if h.inode.chain is not None:
            self.chains.closed(h.inode, who.pid)
        self._maybe_free(h.inode)

    def remove(self, who: Principal, path: str) -> None:
        """Unlink a file; its pages are freed when its last handle closes."""
        self._tick()
        parent, name = self._parent_of(path)
        node = parent.children.get(name)
        if node is None:
            raise NotFound(f"{path} does not exist")
        if isinstance(node, Directory):
            raise IsADirectory(f"{path} is a directory (use rmdir)")
        if not may_unlink(who, parent, node):
            raise PermissionDenied(f"{who.user} may not remove {path}")
        self._unlink(parent, name)

    def mkdir(self, who: Principal, path: str, mode: Optional[int] = None) -> None:
        """A new directory; mode ``mode`` (default ``config.default_dir_mode``,
        0700) less ``config.umask``."""
        self._tick()
        mode = self._new_mode(mode, self.config.default_dir_mode)
        parent, name = self._parent_for_create(who, path)
        d = Directory(name, parent, who.user, mode)
        parent.children[name] = d
        parent.mtime = time.time()
        self.quotas.add_inode(who.user)

    def rmdir(self, who: Principal, path: str) -> None:
        parent, name = self._parent_of(path)
        node = parent.children.get(name)
        if node is None:
            raise NotFound(f"{path} does not exist")
        if not isinstance(node, Directory):
            raise NotADirectory(f"{path} is not a directory")
        if node.children:
            raise DirectoryNotEmpty(f"{path} is not empty")
        if _is_home_dir(path) and not who.is_root:
            raise PermissionDenied(f"{path} is a system directory")
        if not may_unlink(who, parent, node):
            raise PermissionDenied(f"{who.user} may not remove {path}")
        del parent.children[name]
        parent.mtime = time.time()
        self.quotas.drop_inode(node.owner)

    def rename(self, who: Principal, old: str, new: str, rewrite_durable: bool = True) -> Node:
        """Move a file or directory; ``new`` must not exist.  A durable file's copy
        is rewritten under its new path at once, unless not ``rewrite_durable``
        (the caller does it later: until then it is restored under the old path).
        Returns what moved."""
        self._tick()
        op, oname = self._parent_of(old)
        node = op.children.get(oname)
        if node is None:
            raise NotFound(f"{old} does not exist")
        if _is_home_dir(old):
            raise PermissionDenied(f"{old} is a system directory")
        if not may_unlink(who, op, node):
            raise PermissionDenied(f"{who.user} may not move {old}")
        np_, nname = self._parent_for_create(who, new, new_entry=False)
        if isinstance(node, Directory):
            d = np_
            while d is not None:
                if d is node:
                    raise InvalidArgument(f"cannot move {old} into itself")
                d = d.parent
        del op.children[oname]
        if isinstance(node, Inode):
            self.chains.forget(node)                        # its keys belonged to the old directory
        node.name, node.parent = nname, np_
        np_.children[nname] = node
        if isinstance(node, Inode) and node.durable and rewrite_durable:
            from .store import rename_durable
            rename_durable(self, old, node)
        return node

    def chmod(self, who: Principal, path: str, mode: int) -> None:
        """Change a mode (owner or root); ``config.umask`` applies except for root."""
        node = self._lookup(path)
        if not (who.is_root or who.user == node.owner):
            raise PermissionDenied(f"only the owner of {path} may change its mode")
        mode = self._check_mode(mode) if who.is_root else self._new_mode(mode, 0)
        node.mode = mode | (node.mode & STICKY if isinstance(node, Directory) else 0)

    def stat(self, who: Principal, target: Union[str, int]) -> dict:
        """Length, pages per tier, owner, mode, times, advice of a path or handle."""
        self._tick()
        if isinstance(target, str):
            node = self._lookup(target)
        else:
            node = self._handle(who, target).inode
        if isinstance(node, Directory):
            return {"type": "dir", "path": node.path, "owner": node.owner, "mode": node.mode,
                    "entries": len(node.children), "ctime": node.ctime, "mtime": node.mtime}
        tiers = {"device": 0, "host": 0, "disk": 0}
        for b in node.blocks:
            tiers[b.tier] += 1
        return {"type": "file", "path": node.path, "ino": node.ino, "length": node.length,
                "pages": len(node.blocks), "residency": tiers, "owner": node.owner, "mode": node.mode,
                "ctime": node.ctime, "mtime": node.mtime, "atime": node.atime, "advice": node.advice,
                "expire_at": node.expire_at, "durable": node.durable, "open_handles": node.handles,
                "next_position": node.positions[-1] + 1 if node.positions else 0}

    def list(self, who: Principal, path: str = "/") -> list[dict]:
        """Entries of a directory (needs read permission on it)."""
        node = self.listable(who, path)
        return [list_entry(name, child) for name, child in sorted(node.children.items())]

    def listable(self, who: Principal, path: str) -> Directory:
        """The directory ``path``, if ``who`` may list it (else the error); its
        entries are `list_entry` of each child (the kernel lists in slices)."""
        self._tick()
        if path != "/" and split_path(path)[:2] == ["home", who.user]:
            self._home(who.user)
        node = self._lookup(path)
        if not isinstance(node, Directory):
            raise NotADirectory(f"{path} is not a directory")
        if not may(who, node, "r"):
            raise PermissionDenied(f"{who.user} may not list {path}")
        return node

    def advise(self, who: Principal, hid: int, hint: str, seconds: Optional[float] = None) -> None:
        """Pager hints: 'keep' (never evicted), 'drop_first' (swapped out before
        others), 'normal'; 'cache': the pager may *delete* the file (unlink it
        and free its pages; a later open gives NotFound) when memory is needed
        and no handle has it open, least recently used first, before any other
        eviction; 'expire' with ``seconds``: the file is removed from the
        namespace that many seconds from now."""
        h = self._handle(who, hid)
        inode = h.inode
        if not (may(who, inode, "w") or who.user == inode.owner):
            raise PermissionDenied(f"{who.user} may not advise this file")
        if hint == "expire":
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds >= 0:
                raise InvalidArgument("expire needs seconds >= 0")
            inode.expire_at = time.monotonic() + seconds
            heapq.heappush(self._expiry, (inode.expire_at, inode.ino))
        elif hint in ADVICE:
            if seconds is not None:
                raise InvalidArgument(f"advice {hint!r} takes no seconds")
            inode.advice = hint
            inode.expire_at = None                        # a new hint replaces a pending expiry
            self.memory.touch(inode)
        else:
            raise InvalidArgument(f"unknown advice {hint!r} (keep, drop_first, normal, cache, expire)")
        self._tick()

    def renew(self, inode: Inode, seconds: float) -> None:
        """Move a file's pending expiry to ``seconds`` from now (a cache hit; its
        entry in the expiry heap moves when it comes due, see `_tick`)."""
        inode.expire_at = time.monotonic() + seconds

    def sync(self, who: Principal, hid: int) -> None:
        """Write a named file to the durable directory; it is there again after
        a restart (until removed)."""
        from .store import write_durable
        write_durable(self, self.sync_target(who, hid))

    def sync_target(self, who: Principal, hid: int) -> Inode:
        """The file handle ``hid`` names, if ``who`` may sync it (else the error)."""
        h = self._handle(who, hid)
        if h.inode.path is None:
            raise InvalidArgument("an anonymous file cannot be made durable")
        if not may(who, h.inode, "w") and who.user != h.inode.owner:
            raise PermissionDenied(f"{who.user} may not sync {h.inode.path}")
        if not self.config.durable_dir:
            raise InvalidArgument("this kernel has no durable directory (durable_dir) configured")
        return h.inode

    def exit_process(self, pid: int) -> int:
        """Close every handle of a process (its anonymous files die with it) and
        pass its page charges to its user.  Returns the handles closed."""
        hs = self.handles.of_pid(pid)
        for h in hs:
            self._forget_handle(h)
            self._maybe_free(h.inode)
        self.quotas.by_pid.pop(pid, None)          # its blocks' charges are its user's alone now
        self.quotas.peak_by_pid.pop(pid, None)
        return len(hs)

    def close_all(self) -> None:
        """Shut down: release the swap file (durable files are already on disk)."""
        self.pager.close()

    # ================================================================== the parts' API
    # data (data.Data): pred and its step, fork, truncate, extract, merge
    def pred(self, who: Principal, hid: int, tokens, positions=None, *, all_logits: bool = False):
        self._tick()
        return self.data.pred(who, hid, tokens, positions, all_logits=all_logits)

    def pred_batch(self, calls: Sequence[KVPred]) -> list:
        self._tick()
        return self.data.pred_batch(calls)

    def check_pred(self, who: Principal, hid: int, tokens, positions=None, all_logits: bool = False):
        return self.data.check_pred(who, hid, tokens, positions, all_logits)

    def device_need(self, who: Principal, hid: int, n_tokens: int) -> int:
        return self.data.device_need(who, hid, n_tokens)

    def passes(self, calls: Sequence[KVPred]) -> list[list[int]]:
        return self.data.passes(calls)

    def prepare(self, calls: Sequence[KVPred], atomic: bool = False) -> StepPlan:
        self._tick()                                    # due expirations first
        return self.data.prepare(calls, atomic)

    def commit(self, plan: StepPlan, out) -> list:
        return self.data.commit(plan, out)

    def undo(self, plan: StepPlan) -> None:
        self.data.undo(plan)

    def fork(self, who: Principal, hid: int, path: Optional[str] = None, mode: Optional[int] = None) -> int:
        return self.data.fork(who, hid, path, mode)

    def truncate(self, who: Principal, hid: int, n: int) -> None:
        self.data.truncate(who, hid, n)

    def extract(self, who: Principal, hid: int, ranges, path: Optional[str] = None, mode: Optional[int] = None) -> int:
        return self.data.extract(who, hid, ranges, path, mode)

    def merge(self, who: Principal, hids: Sequence[int], path: Optional[str] = None, mode: Optional[int] = None) -> int:
        return self.data.merge(who, hids, path, mode)

    # memory (memory.Memory): counters, what processes hold, reclaim, suspension
    def stats(self) -> dict:
        return {**self.memory.stats(), **self.chains.counters()}

    def pid_blocks(self, pids: Iterable[int]) -> set[int]:
        return self.memory.pid_blocks(pids)

    def pid_device_pages(self, pid: int) -> int:
        return self.memory.pid_device_pages(pid)

    def pid_pages(self, pid: int) -> int:
        return self.memory.pid_pages(pid)

    def resume_need(self, pid: int) -> int:
        return self.memory.resume_need(pid)

    def reclaimable(self, protect: Iterable[int] = frozenset()) -> int:
        return self.memory.reclaimable(protect)

    def cache_pages_by_user(self) -> dict[str, int]:
        return self.memory.cache_pages_by_user()

    def make_quota_room(self, user: str, n: int) -> int:
        return self.memory.make_quota_room(user, n)

    def reclaim(self, n: int, protect: Iterable[int] = frozenset()) -> int:
        return self.memory.reclaim(n, protect)

    def suspend(self, pid: int, keep: Iterable[int] = frozenset(), partial: bool = False) -> int:
        return self.memory.suspend(pid, keep, partial)

    def swap_in_pid(self, pid: int) -> int:
        return self.memory.swap_in_pid(pid)

    # ================================================================== helpers
    def _tick(self) -> None:
        """Apply due expirations (lazy: on each namespace operation)."""
        now = time.monotonic()
        while self._expiry and self._expiry[0][0] <= now:
            _, ino = heapq.heappop(self._expiry)
            inode = self.inodes.get(ino)
            if inode is None or inode.expire_at is None:
                continue
            if inode.expire_at > now:                         # renewed since: due later
                heapq.heappush(self._expiry, (inode.expire_at, ino))
                continue
            inode.expire_at = None
            log.info("KV file %s expired", inode.path or f"<anonymous {ino}>")
            if inode.linked:
                self._unlink(inode.parent, inode.name)
            inode.advice = "drop_first"
            self.memory.touch(inode)

    def _check_mode(self, mode) -> int:
        if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o777:
            raise InvalidArgument(f"mode must be an int in 0..0o777, got {mode!r}")
        return mode

    def _new_mode(self, mode, default: int) -> int:
        """The mode of a new entry: ``mode`` (None: ``default``) less the umask."""
        return (default if mode is None else self._check_mode(mode)) & ~self.config.umask

    def _home(self, user: str) -> Directory:
        home = self.root.children["home"]
        d = home.children.get(user)
        if d is None:
            d = home.children[user] = Directory(user, home, user, 0o700)
        return d

    def _lookup(self, path: str) -> Node:
        parts = split_path(path)
        node: Node = self.root
        for i, p in enumerate(parts):
            if not isinstance(node, Directory):
                raise NotADirectory(f"/{'/'.join(parts[:i])} is not a directory")
            nxt = node.children.get(p)
            if nxt is None:
                raise NotFound(f"{path} does not exist")
            node = nxt
        return node

    def _parent_of(self, path: str) -> tuple[Directory, str]:
        parts = split_path(path)
        if len(parts) < 2:
            raise _system_entry(path)
        parent = self._lookup("/" + "/".join(parts[:-1]))
        if not isinstance(parent, Directory):
            raise NotADirectory(f"{'/' + '/'.join(parts[:-1])} is not a directory")
        return parent, parts[-1]

    def _parent_for_create(self, who: Principal, path: str, new_entry: bool = True) -> tuple[Directory, str]:
        """The directory a new entry ``path`` goes in, after every check (a
        ``new_entry`` also needs room in its creator's inode quota)."""
        parts = split_path(path)
        if len(parts) < 2 or (parts[0] == "home" and len(parts) < 3):
            raise _system_entry(path)
        if parts[0] == "home" and parts[1] == who.user:
            self._home(who.user)
        parent, name = self._parent_of(path)
        if name in parent.children:
            raise AlreadyExists(f"{path} already exists")
        if not may(who, parent, "w"):
            raise PermissionDenied(f"{who.user} may not create entries in {parent.path}")
        if new_entry:
            self.quotas.check_inode(who.user)
        return parent, name

    def _link(self, parent: Directory, name: str, inode: Inode) -> None:
        inode.name, inode.parent, inode.linked = name, parent, True
        parent.children[name] = inode
        parent.mtime = time.time()
        self.quotas.add_inode(inode.owner)

    def _unlink(self, parent: Directory, name: str) -> None:
        inode = parent.children.pop(name)
        parent.mtime = time.time()
        if isinstance(inode, Inode):
            self.chains.forget(inode)
            if inode.durable:
                from .store import remove_durable
                remove_durable(self, inode)
            inode.linked = False
            inode.parent = None
            self.quotas.drop_inode(inode.owner)
            self._maybe_free(inode)

    def _new_handle(self, who: Principal, inode: Inode, writable: bool) -> int:
        n = self.handles.count(who.pid) if who.pid else 0
        if who.pid and n >= self.config.max_handles_per_process:
            raise InvalidArgument(f"process {who.pid} has {n} open KV handles (limit "
                                  f"{self.config.max_handles_per_process})")
        hid = next(self._hids)
        h = Handle(hid, inode, who.pid, who.user, writable)
        self.handles.add(h)
        inode.handles += 1
        return hid

    def _forget_handle(self, h: Handle) -> None:
        h.closed = True
        self.handles.remove(h)
        h.inode.handles -= 1

    def _handle(self, who: Principal, hid) -> Handle:
        return self.handles.of(who, hid)

    def _maybe_free(self, inode: Inode) -> None:
        if inode.linked or inode.handles > 0:
            return
        self.refs.drop(inode.blocks, inode.owner)
        inode.blocks, inode.positions = [], []
        self.inodes.pop(inode.ino, None)
        self.memory.forget(inode)
