"""Decode steps through static, padded buffers, replayed as CUDA graphs.

A decode step (every call in the batch appends exactly one token) launches the
same few hundred kernels every time; only the batch size and the metadata
values change.  `DecodeGraphs` keeps one set of device buffers sized for the
largest batch and, for each *bucket* of batch sizes (1, 2, 4, 8, 16, 24, 32,
48, 64, ...), one forward pass over the first ``bucket`` rows of those buffers:

* on CUDA that forward pass is captured once as a CUDA graph (all buckets share
  one memory pool) and a step is: fill the host staging buffers, copy them to
  the device, replay the graph - one launch instead of hundreds;
* on the CPU there is nothing to capture; the same padded static-buffer path
  runs eagerly.  It is not faster there - it exists so that the padding and
  buffer logic the GPU relies on is tested on every machine.

A batch of B calls runs in the smallest bucket >= B.  The padding rows write
nowhere (slot -1: `write_kv` skips negative slots) and attend to slot 0 of the
null page 0 (kv_len 1), so they read finite values and change nothing; their
logits are dropped.  The page table is as wide as the longest KV file
(`max_pages`); the kernels only read the columns below each row's kv_len, so
stale columns left by earlier steps are never looked at.

Replays overwrite the graph's output buffer, so `run` returns a copy of the
rows asked for: callers may keep logits across steps.

Each graph ends with the step's greedy tokens: the argmax of every row and the copy of the
token ids into a pinned host buffer are captured with the forward pass.  `run_tokens` (a step
in which every call wants only its greedy token) replays the graph, waits for it once and
returns the ids on the host: no argmax launch, no logits copy, no separate device-to-host copy.
A graph may be replayed from another thread than the one that captured it (the kernel's device
thread does): the replay and its copies go to the replaying thread's current stream, on the
model's device.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Sequence

import torch

from .kv_cache import KVPool
from .model import BatchMeta, PagedLlama

log = logging.getLogger("symphony.graphs")

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)


def bucket_sizes(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: powers of two to 8, then steps of 8 to 64,
    then steps of 16 (and ``max_batch`` itself)."""
    sizes = [b for b in _BUCKETS if b < max_batch]
    sizes += list(range(_BUCKETS[-1] + 32, max_batch, 32))
    return sizes + [max_batch]


class DecodeGraphs:
    """One-token-per-call forward passes on static buffers (see the module docstring)."""

    def __init__(self, model: PagedLlama, kv: KVPool, max_batch: int, max_pages: int,
                 capture: bool):
        if capture and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.kv = model, kv
        self.max_batch, self.max_pages = max_batch, max_pages
        self.buckets = bucket_sizes(max_batch)
        self.capture_graphs = capture
        dev = model.device
        i64, i32 = torch.int64, torch.int32
        # Device buffers; bucket b uses the first b rows of each.
        self.tokens = torch.zeros(max_batch, dtype=i64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=i64, device=dev)
        self.slots = torch.full((max_batch,), -1, dtype=i64, device=dev)
        self.page_table = torch.zeros(max_batch, max_pages, dtype=i32, device=dev)
        self.kv_lens = torch.ones(max_batch, dtype=i32, device=dev)
        self.cu_q_lens = torch.arange(max_batch + 1, dtype=i32, device=dev)   # one token each
        self.logit_rows = torch.arange(max_batch, dtype=i64, device=dev)
        # Host staging, pinned on CUDA so the copies are asynchronous DMA.
        pin = dev.type == "cuda"
        self._h_ids = torch.zeros(3, max_batch, dtype=i64, pin_memory=pin)   # tokens, positions, slots
        # Page tables travel packed [n, widest] (not [n, max_pages]: a long-context
        # model has thousands of columns), then a device copy spreads them out.
        self._h_table = torch.zeros(max_batch * max_pages, dtype=i32, pin_memory=pin)
        self._d_table = torch.zeros(max_batch * max_pages, dtype=i32, device=dev)
        self._h_kv_lens = torch.ones(max_batch, dtype=i32, pin_memory=pin)
        self._ids, self._table, self._lens = (self._h_ids.numpy(), self._h_table.numpy(),
                                              self._h_kv_lens.numpy())
        self._copied = torch.cuda.Event() if pin else None   # staging free to refill
        self._h_tokens = torch.zeros(max_batch, dtype=i64, pin_memory=pin)   # each graph's greedy tokens
        self._replayed = torch.cuda.Event() if pin else None  # the last replay, its token copy included
        self.tokens_in_graph = pin             # False after a capture that could not take the copy
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    # ------------------------------------------------------------------ set-up
    def _meta(self, b: int) -> BatchMeta:
        return BatchMeta(tokens=self.tokens[:b], positions=self.positions[:b], slots=self.slots[:b],
                         page_table=self.page_table[:b], cu_q_lens=self.cu_q_lens[:b + 1],
                         kv_lens=self.kv_lens[:b], logit_rows=self.logit_rows[:b])

    def capture(self) -> None:
        """Capture every bucket's graph, largest first (the smaller ones then
        reuse the memory pool the largest one sized).  The buffers hold padding
        (slot -1) meanwhile, so capturing writes nothing to the KV pool."""
        if not self.capture_graphs or self._graphs:
            return
        with self._on_device():
            self._capture()

    def _capture(self) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.model.device)
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):           # warm-up: lazy inits, cuBLAS workspaces
            for b in (self.buckets[-1], self.buckets[0]):
                self.model.forward(self._meta(b), self.kv)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        torch.cuda.synchronize(self.model.device)
        pool = None
        for i, b in enumerate(reversed(self.buckets)):
            try:
                g = self._capture_one(b, pool)
            except RuntimeError as e:
                if not self.tokens_in_graph or i > 0:
                    raise
                # the largest bucket first: without the token copy, every bucket alike
                log.warning("decode graphs: capturing the greedy tokens' copy failed (%s); the graphs end "
                            "with the logits and greedy steps take the argmax after the replay", e)
                self.tokens_in_graph = False
                torch.cuda.synchronize(self.model.device)
                g = self._capture_one(b, pool)
            pool = g.pool()
            self._graphs[b] = g
            log.debug("captured decode graph %d/%d (batch %d)", i + 1, len(self.buckets), b)
        torch.cuda.synchronize(self.model.device)
        log.info("captured %d decode graphs (batch 1..%d) in %.2f s",
                 len(self._graphs), self.max_batch, time.perf_counter() - t0)

    def _capture_one(self, b: int, pool) -> "torch.cuda.CUDAGraph":
        g = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls meanwhile (a LIP arena being registered) do
        # not invalidate the capture
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
            logits = self.model.forward(self._meta(b), self.kv)                # [b, vocab] float32
            if self.tokens_in_graph:                                           # the greedy tokens, to the host
                self._h_tokens[:b].copy_(logits.argmax(-1), non_blocking=True)
        self._outputs[b] = logits
        return g

    # ------------------------------------------------------------------ steps
    def fits(self, n_calls: int, widest: int) -> bool:
        """Whether a decode step of ``n_calls`` calls whose longest page table
        has ``widest`` pages can take this path."""
        return 1 <= n_calls <= self.max_batch and widest <= self.max_pages

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            tables: Sequence[Sequence[int]], kv_lens: Sequence[int]) -> torch.Tensor:
        """One decode step: call i appends ``tokens[i]`` at ``positions[i]``
        into cache slot ``slots[i]``; its page table is ``tables[i]`` and it
        then holds ``kv_lens[i]`` slots.  Returns [n, vocab] float32 logits."""
        n, b = len(tokens), self._stage(tokens, positions, slots, tables, kv_lens)
        with self._on_device():
            if b in self._graphs:
                self._graphs[b].replay()
                return self._outputs[b][:n].clone()
            return self.model.forward(self._meta(b), self.kv)[:n]

    def run_tokens(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int],
                   tables: Sequence[Sequence[int]], kv_lens: Sequence[int]) -> torch.Tensor:
        """`run`'s step when only each call's greedy token is wanted: int64 [n] token ids on the
        host (the argmax and the copy are the graph's last nodes; this waits for them)."""
        n, b = len(tokens), self._stage(tokens, positions, slots, tables, kv_lens)
        with self._on_device():
            if b in self._graphs and not self.tokens_in_graph:
                self._graphs[b].replay()
                return self._outputs[b][:n].argmax(-1).cpu()
            if b in self._graphs:
                self._graphs[b].replay()
                self._replayed.record()
                self._replayed.synchronize()
                return self._h_tokens[:n].clone()
            return self.model.forward(self._meta(b), self.kv)[:n].argmax(-1).cpu()

    def _on_device(self):
        """The model's CUDA device as the current one while a step is launched (a no-op where it
        already is, and on the CPU)."""
        dev = self.model.device
        if dev.type != "cuda" or dev.index is None or torch.cuda.current_device() == dev.index:
            return contextlib.nullcontext()
        return torch.cuda.device(dev)

    def _stage(self, tokens, positions, slots, tables, kv_lens) -> int:
        """Fill the static buffers for a step of ``len(tokens)`` calls; returns its bucket."""
        n = len(tokens)
        b = self.bucket(n)
        if self._copied is not None:
            self._copied.synchronize()          # the last step's copies have left the staging buffers
        ids, table, lens = self._ids, self._table, self._lens
        ids[0, :n], ids[1, :n], ids[2, :n] = tokens, positions, slots
        ids[0, n:b], ids[1, n:b], ids[2, n:b] = 0, 0, -1
        lens[:n], lens[n:b] = kv_lens, 1
        w = max(len(r) for r in tables)
        packed = table[: b * w].reshape(b, w)    # columns past a row's own pages are never read
        for i, row in enumerate(tables):
            packed[i, :len(row)] = row
        packed[n:b, 0] = 0                       # padding rows: the null page
        nb = dict(non_blocking=True)
        with self._on_device():
            self.tokens[:b].copy_(self._h_ids[0, :b], **nb)
            self.positions[:b].copy_(self._h_ids[1, :b], **nb)
            self.slots[:b].copy_(self._h_ids[2, :b], **nb)
            self.kv_lens[:b].copy_(self._h_kv_lens[:b], **nb)
            self._d_table[: b * w].copy_(self._h_table[: b * w], **nb)
            self.page_table[:b, :w].copy_(self._d_table[: b * w].view(b, w))
            if self._copied is not None:
                self._copied.record()
        self.replays += 1
        return b


def decode_step(tables: Sequence[Sequence[int]], lengths: Sequence[int],
                page_size: int) -> tuple[list[int], list[int]]:
    """(slots, kv_lens) of a decode step: call i's new token goes to slot
    ``lengths[i]`` of its file, through its page table ``tables[i]``."""
    slots = [t[n // page_size] * page_size + n % page_size for t, n in zip(tables, lengths)]
    return slots, [n + 1 for n in lengths]


__all__ = ["DecodeGraphs", "bucket_sizes", "decode_step"]
