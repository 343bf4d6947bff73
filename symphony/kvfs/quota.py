"""Page and inode quotas.

Pages, per user and per process: every block is charged to the (user, pid)
whose call created it; a block is uncharged when it is freed, and a process's
charges pass to its user alone when the process exits.

Page references, per user: the entries of the page tables of a user's files
(a fork of a 250-page file maps 250 pages, sharing every one), bounded so that
what the kernel walks for one user stays in proportion to the pages it may
hold: a page is counted once per file that maps it.

A shared page stays charged to its maker while the maker's files map it; when
they no longer do, the charge passes to a user whose file still does (see
`namespace.Block`), which may put that user over their quota: their next
allocation then fails until they free pages.

Inodes, per user: every named file and directory in the namespace counts
against its owner until it is removed (renames change nothing; /home/<user>
itself and the top directories count for nobody).  Anonymous files are bounded
by the handles a process may hold instead.

The user ``root`` (the kernel, and the Unix root client) is exempt from both.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

from .errors import QuotaExceeded
from .namespace import ROOT_USER


class Quotas:
    def __init__(self, user_pages: Optional[int] = None, process_pages: Optional[int] = None,
                 per_user: Optional[dict[str, int]] = None, user_inodes: Optional[int] = None,
                 user_refs: Optional[int] = None):
        limits = {"user_pages": user_pages, "process_pages": process_pages, "user_inodes": user_inodes,
                  "user_refs": user_refs, **{f"per_user[{u!r}]": n for u, n in (per_user or {}).items()}}
        for name, v in limits.items():
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"quota {name} must be None or an int >= 0, got {v!r}")
        self.user_pages, self.process_pages, self.user_inodes = user_pages, process_pages, user_inodes
        self.per_user = dict(per_user or {})
        self.by_user: Counter = Counter()
        self.by_pid: Counter = Counter()
        self.peak_by_pid: Counter = Counter()     # the most pages each live process held at once
        self.inodes_by_user: Counter = Counter()
        self.user_refs = user_refs
        self.refs_by_user: Counter = Counter()    # page-table entries of each user's files

    def limit_for(self, user: str) -> Optional[int]:
        """The pages ``user`` may hold in all tiers (None: no limit; root is exempt)."""
        return None if user == ROOT_USER else self.per_user.get(user, self.user_pages)

    def check_one(self, user: str, pid: int, n: int) -> None:
        """`check` for one caller: ``n`` pages charged to ``user``'s process ``pid``."""
        lim = self.limit_for(user)
        if lim is not None and self.by_user[user] + n > lim:
            raise QuotaExceeded(f"user {user!r} would hold {self.by_user[user] + n} KV pages, "
                                f"quota {lim} ({self.by_user[user] + n - lim} over)")
        if (self.process_pages is not None and user != ROOT_USER and pid
                and self.by_pid[pid] + n > self.process_pages):
            held = self.by_pid[pid] + n
            raise QuotaExceeded(f"process {pid} would hold {held} KV pages, quota "
                                f"{self.process_pages} ({held - self.process_pages} over)")

    def check(self, need: dict[tuple[str, int], int]) -> None:
        """Raise `QuotaExceeded` if charging ``need[(user, pid)]`` pages would
        pass a limit; charges nothing."""
        if len(need) == 1:                          # one caller (every pred): no tallies to build
            (user, pid), n = next(iter(need.items()))
            self.check_one(user, pid, n)
            return
        users, pids = Counter(), Counter()
        for (user, pid), n in need.items():
            users[user] += n
            pids[pid] += n
        for user, n in users.items():
            lim = self.limit_for(user)
            if lim is not None and self.by_user[user] + n > lim:
                raise QuotaExceeded(f"user {user!r} would hold {self.by_user[user] + n} KV pages, "
                                    f"quota {lim} ({self.by_user[user] + n - lim} over)")
        if self.process_pages is not None:
            for (user, pid), n in need.items():
                if user != ROOT_USER and pid and self.by_pid[pid] + pids[pid] > self.process_pages:
                    held = self.by_pid[pid] + pids[pid]
                    raise QuotaExceeded(f"process {pid} would hold {held} KV pages, quota "
                                        f"{self.process_pages} ({held - self.process_pages} over)")

    def charge(self, user: str, pid: int, n: int = 1) -> None:
        self.by_user[user] += n
        if pid:
            self.by_pid[pid] += n
            if self.by_pid[pid] > self.peak_by_pid[pid]:
                self.peak_by_pid[pid] = self.by_pid[pid]

    def peak(self, pid: int) -> int:
        """The most pages process ``pid`` held at once (0 once it has exited)."""
        return self.peak_by_pid.get(pid, 0)

    def uncharge(self, user: str, pid: int, n: int = 1) -> None:
        self.by_user[user] -= n
        if pid in self.by_pid:                 # (an exited process's charges are its user's alone)
            self.by_pid[pid] -= n

    # ------------------------------------------------------------------ page references
    def check_refs(self, user: str, n: int) -> None:
        """Raise `QuotaExceeded` if ``user``'s files may not map ``n`` more pages."""
        lim = self.user_refs
        if n > 0 and user != ROOT_USER and lim is not None and self.refs_by_user[user] + n > lim:
            raise QuotaExceeded(f"user {user!r}'s KV files would map {self.refs_by_user[user] + n} pages "
                                f"(forks count every page they share), at most {lim} "
                                f"(symphony-kernel --user-page-refs)")

    # ------------------------------------------------------------------ inodes
    def check_inode(self, user: str) -> None:
        """Raise `QuotaExceeded` if ``user`` may not name one more file or directory."""
        lim = self.user_inodes
        if user != ROOT_USER and lim is not None and self.inodes_by_user[user] + 1 > lim:
            raise QuotaExceeded(f"user {user!r} has {self.inodes_by_user[user]} named KV files and "
                                f"directories, inode quota {lim}")

    def add_inode(self, user: str) -> None:
        self.inodes_by_user[user] += 1

    def drop_inode(self, user: str) -> None:
        self.inodes_by_user[user] -= 1
        if self.inodes_by_user[user] <= 0:
            del self.inodes_by_user[user]
