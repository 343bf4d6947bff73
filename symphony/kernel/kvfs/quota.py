"""Page quotas per user and per process.  Every block is charged to the (user,
pid) whose call created it; a block is uncharged when it is freed, and a
process's charges pass to its user alone when the process exits."""
from __future__ import annotations

from collections import Counter
from typing import Optional

from .errors import QuotaExceeded
from .namespace import ROOT_USER


class Quotas:
    def __init__(self, user_pages: Optional[int] = None, process_pages: Optional[int] = None,
                 per_user: Optional[dict[str, int]] = None):
        self.user_pages, self.process_pages = user_pages, process_pages
        self.per_user = dict(per_user or {})
        self.by_user: Counter = Counter()
        self.by_pid: Counter = Counter()

    def limit_for(self, user: str) -> Optional[int]:
        return self.per_user.get(user, self.user_pages)

    def check(self, need: dict[tuple[str, int], int]) -> None:
        """Raise `QuotaExceeded` if charging ``need[(user, pid)]`` pages would
        pass a limit; charges nothing."""
        users, pids = Counter(), Counter()
        for (user, pid), n in need.items():
            users[user] += n
            pids[pid] += n
        for user, n in users.items():
            lim = self.limit_for(user)
            if user != ROOT_USER and lim is not None and self.by_user[user] + n > lim:
                raise QuotaExceeded(f"user {user!r} would hold {self.by_user[user] + n} KV pages, "
                                    f"quota {lim}")
        if self.process_pages is not None:
            for (user, pid), n in need.items():
                if user != ROOT_USER and pid and self.by_pid[pid] + pids[pid] > self.process_pages:
                    raise QuotaExceeded(f"process {pid} would hold {self.by_pid[pid] + pids[pid]} KV "
                                        f"pages, quota {self.process_pages}")

    def charge(self, user: str, pid: int, n: int = 1) -> None:
        self.by_user[user] += n
        if pid:
            self.by_pid[pid] += n

    def uncharge(self, user: str, pid: int, n: int = 1) -> None:
        self.by_user[user] -= n
        if pid:
            self.by_pid[pid] -= n
