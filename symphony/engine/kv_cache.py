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
from .hostmem import Committer
from .page_allocator import PageAllocator, pages_for


class KVPool:
    """The page pool and its allocator (which pages are free; their sharing is KVFS's)."""

    def __init__(self, model: ModelConfig, config: EngineConfig):
        self.page_size = config.page_size
        self.num_pages = config.resolve_num_pages(model)
        self.allocator = PageAllocator(self.num_pages)
        shape = (model.n_layers, 2, self.num_pages, self.page_size, model.n_kv_heads, model.head_dim)
        # [n_layers, 2, num_pages, page_size, n_kv_heads, head_dim]
        self.pool = zeros_lazy(shape, config.torch_kv_dtype, config.torch_device)
        self.page_bytes = self.pool[:, :, 0].numel() * self.pool.element_size()
        self.kv_commit = config.kv_commit
        self.committer: Optional[Committer] = None

    def start_commit(self) -> None:
        """With ``kv_commit="background"`` and the pool in host memory: commit its memory
        now, on a thread of its own, so that no step pays the first write of a page. Call
        it once the engine is set up (after the kernels' calibration, which it would
        disturb). Idempotent; nothing for a lazy pool or one on a GPU."""
        if self.kv_commit == "background" and self.committer is None and self.pool.device.type == "cpu":
            self.committer = Committer(self.pool, f"KV pool ({self.pool.nbytes / 2**20:.0f} MiB)")
            self.committer.start()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i, each [num_pages, page_size, n_kv_heads, head_dim]."""
        return self.pool[i, 0], self.pool[i, 1]

    # ------------------------------------------------------------------ page operations
    # KVFS moves pages only through these (copy-on-write, extract and merge,
    # swaps, durable files), so that a pool whose heads are split across
    # tensor-parallel ranks (engine/tp/) can do each on every rank.  Data
    # outside the pool is always whole pages of every KV head:
    # [n_layers, 2, pages, page_size, n_kv_heads, head_dim] (`page_shape` per page).

    @property
    def page_shape(self) -> list[int]:
        """One page of every KV head: [n_layers, 2, page_size, n_kv_heads, head_dim]."""
        s = list(self.pool.shape)
        return [s[0], s[1]] + s[3:]

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def copy_page(self, src: int, dst: int, n: Optional[int] = None) -> None:
        """Copy the first ``n`` slots (all by default) of page src into page dst."""
        n = self.page_size if n is None else n
        self.pool[:, :, dst, :n].copy_(self.pool[:, :, src, :n])

    def copy_slots(self, src_pages: list[int], src_offs: list[int], dst_pages: list[int],
                   dst_offs: list[int]) -> None:
        """Slot ``src_offs[i]`` of page ``src_pages[i]`` into slot ``dst_offs[i]`` of
        page ``dst_pages[i]`` (extract, merge)."""
        t = lambda x: torch.tensor(x, device=self.pool.device)
        self.pool[:, :, t(dst_pages), t(dst_offs)] = self.pool[:, :, t(src_pages), t(src_offs)]

    def copy_out(self, pages: list[int], dst: torch.Tensor, dst_idx: list[int]) -> None:
        """``dst[:, :, dst_idx[i]] = page pages[i]`` for a tensor of whole pages
        ``dst`` [L, 2, N, S, H, D] (a host chunk of the swap tier)."""
        _copy(dst, dst_idx, self.pool, pages)

    def copy_in(self, pages: list[int], src: torch.Tensor, src_idx: list[int]) -> None:
        """Page ``pages[i]`` = ``src[:, :, src_idx[i]]``, the inverse of `copy_out`."""
        _copy(self.pool, pages, src, src_idx)

    def read_page(self, p: int) -> torch.Tensor:
        """A copy of page ``p`` on the CPU, [L, 2, S, H, D] (never a view of the pool)."""
        return self.pool[:, :, p].to("cpu", copy=True)

    def write_page(self, p: int, data: torch.Tensor) -> None:
        """The first ``data.shape[2]`` slots of page ``p`` = ``data`` [L, 2, n, H, D]."""
        self.pool[:, :, p, :data.shape[2]] = data.to(self.pool.device)

    def close(self) -> None:
        """Stop committing the pool's memory (a sharded pool also stops its ranks)."""
        if self.committer is not None:
            self.committer.stop()

    def pages_for(self, n_slots: int) -> int:
        """Pages needed to hold ``n_slots`` slots."""
        return pages_for(n_slots, self.page_size)


def _copy(dst: torch.Tensor, dst_idx: list[int], src: torch.Tensor, src_idx: list[int]) -> None:
    """dst[:, :, dst_idx[i]] = src[:, :, src_idx[i]] for pools [L, 2, pages, S, H, D].
    Between CPU tensors a loop of page copies is 4-5x faster than fancy
    indexing (measured); across devices one gather + one transfer is."""
    if dst.device == src.device:
        for d, s_ in zip(dst_idx, src_idx):
            dst[:, :, d].copy_(src[:, :, s_])
    else:
        gathered = src[:, :, torch.tensor(src_idx, device=src.device)]
        dst[:, :, torch.tensor(dst_idx, device=dst.device)] = gathered.to(dst.device, non_blocking=True)


def zeros_lazy(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor.  On the CPU its memory is committed only as pages
    are first written: numpy's zeros is calloc, which maps fresh zero pages for
    a large block instead of writing zeros (torch.zeros writes them all, so a
    256 MiB KV pool cost 256 MiB of RSS at start).  Elsewhere: torch.zeros.

    In 4 KiB pages, not huge pages: numpy advises transparent huge pages for large
    arrays, and then the first write into each 2 MiB of the pool, which a step does
    when it fills a fresh KV page, faults in and zeroes a huge page - on a virtual
    machine so slowly that writing a 2 GiB pool once took 18.7 s against 0.72 s in
    4 KiB pages, and a kernel under load spent ~40 % of its steps there (150 vs 89 ms
    a step of ~160 tokens on an Intel Xeon VM, 2 vCPUs)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np
    n = 1
    for d in shape:
        n *= d
    hugepage = _numpy_hugepage()
    old = hugepage(False) if hugepage is not None else None
    try:
        raw = torch.from_numpy(np.zeros(n * torch.empty((), dtype=dtype).element_size(), dtype=np.uint8))
    finally:
        if hugepage is not None:
            hugepage(old)
    return raw.view(dtype).view(shape)


def _numpy_hugepage():
    """numpy's switch for advising huge pages on large arrays (returns the old setting),
    or None where this numpy has none."""
    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            return getattr(__import__(mod, fromlist=["_set_madvise_hugepage"]), "_set_madvise_hugepage")
        except (ImportError, AttributeError):
            continue
    return None


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
