"""KV tiers and the pager: device pages -> host memory -> disk.

    device   the engine's KVPool pages (GPU memory, or RAM on a CPU engine)
    host     pages of the same shape in host memory, pinned when CUDA is
             present so copies to and from the device are DMA transfers; the
             tier grows by `HOST_CHUNK` pages when it needs room, up to
             ``host_pages``, so an idle kernel holds no pinned memory
    disk     a swap file of page-sized slots in ``swap_dir``

A `Block` is in exactly one tier.  `swap_out` moves device blocks to the host
(demoting the least recently swapped host blocks to disk to make room);
`swap_in` brings any blocks back to device pages.  Which blocks to evict is
the file system's choice (advice, then LRU), passed in as an iterator.
"""
from __future__ import annotations

import logging
import math
import os
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch

from symphony.engine.kv_cache import KVPool
from .errors import NoSpace
from .namespace import Block

log = logging.getLogger("symphony.kvfs.pager")

HOST_CHUNK = 64          # pages the host tier grows by


@dataclass
class PagerStats:
    """Counters since start (pages unless named bytes); KVFS adds its own."""

    swap_outs: int = 0       # device -> host/disk
    swap_ins: int = 0        # host/disk -> device
    demotions: int = 0       # host -> disk
    disk_reads: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    cache_drops: int = 0     # cache files deleted to free memory (KVFS)
    cache_drop_pages: int = 0
    suspensions: int = 0     # whole processes moved off the device (KVFS.suspend)


class Pager:
    def __init__(self, kv: KVPool, host_pages: int, swap_dir: Optional[Path], disk_pages: int):
        self.kv, self.alloc = kv, kv.allocator
        self.host_max = max(host_pages, 0)
        self.host_chunks: list[torch.Tensor] = []  # [L, 2, HOST_CHUNK, S, H, D] each, made on demand
        self.host_free: list[int] = []             # free slots among those made
        self.host_lru: "OrderedDict[Block, None]" = OrderedDict()   # oldest first, for demotion
        self.page_shape = kv.page_shape                                # one page: [L, 2, S, H, D]
        self.page_bytes = math.prod(self.page_shape) * torch.empty((), dtype=kv.dtype).element_size()
        self.disk_pages = disk_pages if swap_dir is not None else 0
        self.disk_free: list[int] = []
        self.disk_next = 0
        self._fd = -1
        if self.disk_pages:
            swap_dir = Path(swap_dir)
            swap_dir.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="swap-", suffix=".kv", dir=swap_dir)
            os.unlink(name)                  # anonymous: vanishes with the process
            self._fd = fd
        self.stats = PagerStats()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ------------------------------------------------------------------ capacity
    @property
    def host_capacity(self) -> int:
        """Host slots in memory now (the tier grows up to ``host_max`` = ``host_pages``)."""
        return min(len(self.host_chunks) * HOST_CHUNK, self.host_max)

    def host_slots_free(self) -> int:
        """Host slots free now or still to be made."""
        return len(self.host_free) + self.host_max - self.host_capacity

    def all_resident(self) -> bool:
        """Whether every block is on the device (none on the host or on disk: the common case,
        in which nothing needs to be swapped in)."""
        return not self.host_lru and self.disk_next == len(self.disk_free)

    def free_slots(self) -> int:
        """Non-device slots left (host + disk)."""
        return self.host_slots_free() + len(self.disk_free) + (self.disk_pages - self.disk_next)

    # ------------------------------------------------------------------ moves
    def make_room(self, n: int, victims: Iterator[Block],
                  make_slots: Optional[Callable[[int], None]] = None) -> None:
        """Evict blocks from ``victims`` until ``n`` device pages are free.
        ``make_slots(k)`` is asked to free ``k`` host/disk slots when those
        tiers cannot take the victims.  Raises `NoSpace`, changing nothing
        (but what ``make_slots`` deleted), saying which resource ran out."""
        free = self.alloc.num_free
        short = n - free
        if short <= 0:
            return
        batch, seen = [], set()
        for b in victims:
            if b.device >= 0 and b.id not in seen:        # a block two files share comes twice
                seen.add(b.id)
                batch.append(b)
                if len(batch) == short:
                    break
        if len(batch) < short:
            raise NoSpace(f"need {n} free device KV pages: {free} free and only {len(batch)} more "
                          f"evictable (the others belong to running LIPs, 'keep' files or this call)")
        if self.free_slots() < len(batch) and make_slots is not None:
            make_slots(len(batch) - self.free_slots())
        if self.free_slots() < len(batch):
            raise NoSpace(f"need {n} free device KV pages: {free} free and {len(batch)} evictable, "
                          f"but the host and disk tiers ran out of slots for them: "
                          f"{self.slots_report()}")
        self.swap_out(batch)

    def slots_report(self) -> str:
        """Free host/disk slots, in words (for error messages)."""
        host = self.host_slots_free()
        disk = (f"disk {self.free_slots() - host} of {self.disk_pages}"
                if self.disk_pages else "no disk tier (no swap directory)")
        return f"{self.free_slots()} free (host {host} of {self.host_max}, {disk})"

    def swap_out(self, blocks: list[Block]) -> None:
        """Move device blocks off the device: to host slots, demoting the oldest
        host blocks to disk for room; what the host cannot take goes to disk.
        Victims come oldest first, so the oldest go furthest."""
        blocks = list({b.id: b for b in blocks if b.device >= 0}.values())   # each block once
        if not blocks:
            return
        if self.free_slots() < len(blocks):
            raise NoSpace(f"cannot swap out {len(blocks)} KV pages: host and disk slots: "
                          f"{self.slots_report()}")
        self._grow_host(len(blocks))
        short = len(blocks) - len(self.host_free)
        if short > 0:
            self._demote(min(short, len(self.host_lru)))
        n_disk = max(0, len(blocks) - len(self.host_free))
        to_disk, to_host = blocks[:n_disk], blocks[n_disk:]
        for b in to_disk:
            slot = self.disk_free.pop() if self.disk_free else self._grow_disk()
            self._write_disk(slot, self.kv.read_page(b.device))
            b.disk = slot
        if to_host:
            slots = [self.host_free.pop() for _ in to_host]
            for chunk, idx in self._by_chunk(slots):
                self.kv.copy_out([to_host[i].device for i in idx], chunk,
                                 [slots[i] % HOST_CHUNK for i in idx])
            for b, h in zip(to_host, slots):
                b.host = h
                self.host_lru[b] = None
        self.alloc.free([b.device for b in blocks])
        for b in blocks:
            b.device = -1
        self.stats.swap_outs += len(blocks)
        self.stats.swap_out_bytes += len(blocks) * self.page_bytes
        log.debug("swapped out %d blocks (%d to disk)", len(blocks), len(to_disk))

    def swap_in(self, blocks: Iterable[Block]) -> None:
        """Bring blocks to device pages; the caller made room first."""
        todo = [b for b in blocks if b.device < 0]
        if not todo:
            return
        pages = self.alloc.allocate(len(todo))
        on_host = [(b, p) for b, p in zip(todo, pages) if b.host >= 0]
        if on_host:
            for chunk, idx in self._by_chunk([b.host for b, _ in on_host]):
                self.kv.copy_in([on_host[i][1] for i in idx], chunk,
                                [on_host[i][0].host % HOST_CHUNK for i in idx])
            for b, _ in on_host:
                self.host_free.append(b.host)
                self.host_lru.pop(b, None)
                b.host = -1
        for b, p in zip(todo, pages):
            if b.disk >= 0:
                self.kv.write_page(p, self._read_disk(b.disk))
                self.disk_free.append(b.disk)
                b.disk = -1
                self.stats.disk_reads += 1
            b.device = p
        self.stats.swap_ins += len(todo)
        self.stats.swap_in_bytes += len(todo) * self.page_bytes

    def release(self, b: Block) -> None:
        """Free whatever the block occupies (its last reference is gone)."""
        if b.device >= 0:
            self.alloc.free([b.device])
            b.device = -1
        elif b.host >= 0:
            self.host_free.append(b.host)
            self.host_lru.pop(b, None)
            b.host = -1
        elif b.disk >= 0:
            self.disk_free.append(b.disk)
            b.disk = -1

    def read(self, b: Block) -> torch.Tensor:
        """A copy of a block's data, [n_layers, 2, page_size, n_kv_heads, head_dim], on the CPU
        (never a view of the pool, whose page may be reused once the block moves)."""
        if b.device >= 0:
            return self.kv.read_page(b.device)
        if b.host >= 0:
            return self._host_page(b.host).clone()
        return self._read_disk(b.disk)

    # ------------------------------------------------------------------ helpers
    def _grow_host(self, n: int) -> None:
        """Make host chunks until ``n`` host slots are free or the tier is at ``host_pages``."""
        kv = self.kv
        while len(self.host_free) < n and self.host_capacity < self.host_max:
            shape = self.page_shape[:2] + [HOST_CHUNK] + self.page_shape[2:]
            first = self.host_capacity
            self.host_chunks.append(torch.empty(shape, dtype=kv.dtype, pin_memory=kv.device.type == "cuda"))
            self.host_free[:0] = range(self.host_capacity - 1, first - 1, -1)   # the last chunk may be cut short
            log.debug("host KV tier grew to %d pages", self.host_capacity)

    def _host_page(self, slot: int) -> torch.Tensor:
        return self.host_chunks[slot // HOST_CHUNK][:, :, slot % HOST_CHUNK]

    def _by_chunk(self, slots: list[int]) -> Iterator[tuple[torch.Tensor, list[int]]]:
        """(host chunk, indices into ``slots`` of the slots in it), per chunk used."""
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(slots):
            groups.setdefault(s // HOST_CHUNK, []).append(i)
        for c, idx in groups.items():
            yield self.host_chunks[c], idx

    def _demote(self, n: int) -> None:
        """Move the ``n`` least recently swapped host blocks to disk."""
        for _ in range(n):
            b, _ = self.host_lru.popitem(last=False)
            slot = self.disk_free.pop() if self.disk_free else self._grow_disk()
            self._write_disk(slot, self._host_page(b.host))
            self.host_free.append(b.host)
            b.host, b.disk = -1, slot
            self.stats.demotions += 1

    def _write_disk(self, slot: int, page: torch.Tensor) -> None:
        data = page.contiguous().cpu()
        os.pwrite(self._fd, data.view(torch.uint8).numpy().tobytes(), slot * self.page_bytes)

    def _grow_disk(self) -> int:
        slot = self.disk_next
        self.disk_next += 1
        return slot

    def _read_disk(self, slot: int) -> torch.Tensor:
        raw = os.pread(self._fd, self.page_bytes, slot * self.page_bytes)
        if len(raw) != self.page_bytes:
            raise NoSpace(f"swap file read of slot {slot} came back short")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(self.kv.dtype).view(self.page_shape)
