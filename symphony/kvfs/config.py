"""KVFS's configuration: its tiers, durable directory, quotas and defaults."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class KVFSConfig:
    host_pages: int = 256                   # host-memory tier, in pages
    swap_dir: Optional[str] = None          # disk tier (swap file) directory; None: no disk tier
    disk_pages: int = 65536
    durable_dir: Optional[str] = None       # where sync() writes durable files; None: no sync
    user_page_quota: Optional[int] = None   # pages a user may hold (all tiers); None: unlimited
    process_page_quota: Optional[int] = None
    per_user_quota: Optional[dict] = None   # {user: pages} overrides
    user_inode_quota: Optional[int] = 10000  # named files + directories a user may own; None: unlimited
    user_ref_quota: Optional[int] = None    # pages a user's files may map (forks count each); None: unlimited
    default_file_mode: int = 0o600          # a file created without a mode
    default_dir_mode: int = 0o700           # a directory made without a mode
    umask: int = 0o022                      # bits cleared from every mode a caller asks for
    max_handles_per_process: int = 4096
