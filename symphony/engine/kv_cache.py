"""The KV page pool (torch tensors) and the KV sequence (a page table + length).

Pool layout, one tensor for the whole cache::

    pool: [n_layers, 2, num_pages, page_size, n_kv_heads, head_dim]
                     ^ 0 = K, 1 = V

so ``pool[l, 0]`` is layer l's K cache ``[num_pages, page_size, n_kv_heads,
head_dim]``, contiguous, as the paged-attention op expects.  A sequence's
slot j lives in page ``pages[j // page_size]`` at offset ``j % page_size``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .config import EngineConfig, ModelConfig
from .page_allocator import PageAllocator, pages_for


class KVPool:
    """The page pool and its allocator (which pages are free; their sharing is KVFS's)."""

    def __init__(self, model: ModelConfig, config: EngineConfig):
        self.page_size = config.page_size
        self.num_pages = config.resolve_num_pages(model)
        self.allocator = PageAllocator(self.num_pages)
        shape = (model.n_layers, 2, self.num_pages, self.page_size, model.n_kv_heads, model.head_dim)
        # [n_layers, 2, num_pages, page_size, n_kv_heads, head_dim]
        self.pool = zeros_lazy(shape, config.torch_dtype, config.torch_device)
        self.page_bytes = self.pool[:, :, 0].numel() * self.pool.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i, each [num_pages, page_size, n_kv_heads, head_dim]."""
        return self.pool[i, 0], self.pool[i, 1]

    def copy_page(self, src: int, dst: int, n: Optional[int] = None) -> None:
        """Copy the first ``n`` slots (all by default) of page src into page dst."""
        n = self.page_size if n is None else n
        self.pool[:, :, dst, :n].copy_(self.pool[:, :, src, :n])

    def pages_for(self, n_slots: int) -> int:
        """Pages needed to hold ``n_slots`` slots."""
        return pages_for(n_slots, self.page_size)


def zeros_lazy(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor.  On the CPU its memory is committed only as pages
    are first written: numpy's zeros is calloc, which maps fresh zero pages for
    a large block instead of writing zeros (torch.zeros writes them all, so a
    256 MiB KV pool cost 256 MiB of RSS at start).  Elsewhere: torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np
    n = 1
    for d in shape:
        n *= d
    raw = torch.from_numpy(np.zeros(n * torch.empty((), dtype=dtype).element_size(), dtype=np.uint8))
    return raw.view(dtype).view(shape)


@dataclass
class KVSequence:
    """A KV file's content: its pages, length in slots, and each slot's position.

    ``positions[j]`` is the RoPE position token j was written at; it equals j
    for a file filled by plain appends, and differs after extract/merge or
    explicit positions.
    """

    pages: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.positions)

    @property
    def next_position(self) -> int:
        """Default position of the next appended token."""
        return self.positions[-1] + 1 if self.positions else 0
