"""Rank 0's KV pool when the KV heads are split across ranks.

Page ids are the same on every rank; each rank's pool holds its KV heads of
every page (`Shard.kv_heads`).  Rank 0's pool is the local part, which its
forward pass reads like any pool; every page operation KVFS makes
(`KVPool`'s copy_page, copy_slots, copy_out/copy_in, read_page/write_page) is
sent to every rank as well (group.py).  Data that leaves the pool is whole
pages of every KV head, gathered at rank 0, and comes back scattered: the host
and disk tiers and the durable files hold the same bytes at any --tp, so a
file written at one size is read back at another.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config import EngineConfig, ModelConfig
from ..kv_cache import KVPool
from .group import COPY_PAGE, COPY_SLOTS, GATHER, SCATTER, STOP, TPGroup
from .shard import Shard


class ShardedKVPool(KVPool):
    """Rank 0's part of a KV pool split by heads, with the page operations of the whole."""

    def __init__(self, model: ModelConfig, local: ModelConfig, config: EngineConfig, group: TPGroup):
        super().__init__(local, config)
        self.group, self.model = group, model
        self.n_kv = model.n_kv_heads
        # for each KV head of the model: (rank, index in that rank's pool) of its first holder
        self.owner: list[tuple[int, int]] = []
        for h in range(self.n_kv):
            for r in range(group.size):
                k0, k1 = Shard(r, group.size).kv_heads(model)
                if k0 <= h < k1:
                    self.owner.append((r, h - k0))
                    break
        self.spans = [Shard(r, group.size).kv_heads(model) for r in range(group.size)]

    @property
    def page_shape(self) -> list[int]:
        s = list(self.pool.shape)
        return [s[0], s[1], s[3], self.n_kv, s[5]]

    # ------------------------------------------------------------------ on every rank
    def copy_page(self, src: int, dst: int, n: Optional[int] = None) -> None:
        n = self.page_size if n is None else n
        self.group.send(COPY_PAGE, (src, dst, n))
        super().copy_page(src, dst, n)

    def copy_slots(self, src_pages, src_offs, dst_pages, dst_offs) -> None:
        self.group.send(COPY_SLOTS, (len(src_pages),),
                        torch.tensor([*src_pages, *src_offs, *dst_pages, *dst_offs], dtype=torch.int64))
        super().copy_slots(src_pages, src_offs, dst_pages, dst_offs)

    def copy_out(self, pages: list[int], dst: torch.Tensor, dst_idx: list[int]) -> None:
        full = self.gather_pages(pages)
        for i, d in enumerate(dst_idx):
            dst[:, :, d].copy_(full[:, :, i])

    def copy_in(self, pages: list[int], src: torch.Tensor, src_idx: list[int]) -> None:
        self.scatter_pages(pages, torch.stack([src[:, :, i] for i in src_idx], dim=2), self.page_size)

    def read_page(self, p: int) -> torch.Tensor:
        return self.gather_pages([p])[:, :, 0].clone()

    def write_page(self, p: int, data: torch.Tensor) -> None:
        self.scatter_pages([p], data.unsqueeze(2), data.shape[2])

    # ------------------------------------------------------------------ gather / scatter
    def gather_pages(self, pages: list[int]) -> torch.Tensor:
        """Whole pages [L, 2, n, S, H, D] on the CPU, every rank's heads."""
        self.group.send(GATHER, (), torch.tensor(pages, dtype=torch.int64))
        mine = local_pages(self.pool, pages)
        parts = self.group.gather(mine)
        L, _, S, _, D = self.page_shape
        full = torch.empty((L, 2, len(pages), S, self.n_kv, D), dtype=self.pool.dtype)
        for h, (r, j) in enumerate(self.owner):
            full[..., h, :] = parts[r][..., j, :]
        return full

    def scatter_pages(self, pages: list[int], full: torch.Tensor, n: int) -> None:
        """Slots [0, n) of ``pages`` = ``full`` [L, 2, len(pages), n, H, D], each rank its heads."""
        self.group.send(SCATTER, (n,), torch.tensor(pages, dtype=torch.int64))
        parts = [full[..., k0:k1, :].contiguous() for k0, k1 in self.spans]
        write_local(self.pool, pages, n, self.group.scatter(parts, parts[0]))

    def close(self) -> None:
        """Stop the other ranks and leave the group (once)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        super().close()
        if not self.group.broken:
            try:
                self.group.send(STOP)
            except Exception:
                pass
        self.group.close()


def local_pages(pool: torch.Tensor, pages: list[int]) -> torch.Tensor:
    """This rank's part of ``pages``: [L, 2, n, S, h, D] on the CPU."""
    return pool[:, :, torch.tensor(pages, device=pool.device)].cpu()


def write_local(pool: torch.Tensor, pages: list[int], n: int, part: torch.Tensor) -> None:
    """Slots [0, n) of ``pages`` = ``part`` [L, 2, len(pages), n, h, D]."""
    part = part.to(pool.device)
    for i, p in enumerate(pages):
        pool[:, :, p, :n] = part[:, :, i]
