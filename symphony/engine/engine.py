"""The in-process engine: the semantics of the ``pred`` system call.

    engine = Engine.load()                         # embedded SmolLM2 on the CPU
    kv = engine.new_sequence()
    logits = engine.pred(kv, tokenizer.encode("Hello"))   # [vocab] for the last token
    logits = engine.pred(kv, [logits.argmax().item()])    # appended after the end

``pred(kv, tokens, positions=None, all_logits=False)`` appends the tokens' K/V
to ``kv`` (RoPE positions ``positions``, by default continuing after the last
one), runs one forward pass and returns float32 next-token logits for the last
token (``[vocab]``), or for every token (``[n, vocab]``) with ``all_logits``.
`pred_batch` runs many such calls, on different sequences, mixed prefill and
decode, as ONE forward pass.  A call with bad arguments raises `PredError`
(or `OutOfPages`) before anything changes: no sequence is touched, no page is
taken.

The engine is not re-entrant: callers (the kernel's scheduler) serialize
calls; a lock makes concurrent misuse safe rather than fast.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np
import torch

from .config import EngineConfig
from .graphs import DecodeGraphs, decode_step
from .kv_cache import KVPool, KVSequence
from .model import BatchMeta, PagedLlama
from .page_allocator import OutOfPages
from symphony.tokenizer import Tokenizer
from .quant import prepare_weights
from .weights import ModelWeights

log = logging.getLogger("symphony.engine")

TokenArray = Union[Sequence[int], np.ndarray, torch.Tensor]


class PredError(ValueError):
    """Invalid pred() arguments; nothing was changed."""


@dataclass
class PredRequest:
    seq: KVSequence
    tokens: TokenArray
    positions: Optional[TokenArray] = None
    all_logits: bool = False


@dataclass
class EngineStats:
    forward_passes: int = 0
    pred_calls: int = 0
    tokens: int = 0
    max_batch_calls: int = 0
    forward_seconds: float = 0.0
    graph_steps: int = 0                               # decode steps on the static (graph) path
    batch_sizes: dict = field(default_factory=dict)   # calls per pass -> count


class Engine:
    def __init__(self, weights: ModelWeights, tokenizer: Optional[Tokenizer] = None,
                 config: EngineConfig = EngineConfig()):
        self.config = config
        self.model_config = weights.config
        self.tokenizer = tokenizer
        self.device, self.dtype = config.torch_device, config.torch_dtype
        weights = prepare_weights(weights, config.keep_quantized, config.quantize)
        self.model = PagedLlama(weights, self.device, self.dtype, config.use_float32_head)
        self.kv = KVPool(self.model_config, config)
        self.page_size = self.kv.page_size
        self.max_seq_len = min(config.max_seq_len or self.model_config.max_context,
                               self.model_config.max_context)
        self.stats = EngineStats()
        self._lock = threading.RLock()
        self.graphs: Optional[DecodeGraphs] = None
        if config.use_graphs:
            self.graphs = DecodeGraphs(self.model, self.kv, config.graph_max_batch,
                                       self.kv.pages_for(self.max_seq_len),
                                       capture=self.device.type == "cuda")
            self.graphs.capture()
        log.info("engine ready: %s on %s/%s, %d KV pages of %d positions (%.1f MiB)",
                 self.model_config.name or self.model_config.arch, self.device, self.dtype,
                 self.kv.num_pages, self.page_size, self.kv.num_pages * self.kv.page_bytes / 2**20)

    @classmethod
    def load(cls, path=None, config: EngineConfig = EngineConfig(), progress: bool = True) -> "Engine":
        """Load a model from disk (default: the embedded SmolLM2) and build an engine."""
        from .loader import load_model
        weights, tok = load_model(path, progress=progress, keep_quantized=config.keep_quantized)
        return cls(weights, tok, config)

    # ------------------------------------------------------------------ sequences
    def new_sequence(self) -> KVSequence:
        return KVSequence()

    def release(self, seq: KVSequence) -> None:
        """Drop the sequence's pages (shared pages stay with their other owners)."""
        with self._lock:
            self.kv.allocator.decref(seq.pages)
            seq.pages, seq.positions = [], []

    def fork(self, seq: KVSequence) -> KVSequence:
        """Copy-on-write clone: every page shared; the partial last page is copied
        only when one side appends to it."""
        with self._lock:
            self.kv.allocator.incref(seq.pages)
            return KVSequence(list(seq.pages), list(seq.positions))

    def truncate(self, seq: KVSequence, n: int) -> None:
        """Keep the first ``n`` slots; pages past them are released."""
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= seq.length:
            raise PredError(f"truncate length must be an int in [0, {seq.length}], got {n!r}")
        with self._lock:
            keep = self.kv.pages_for(n)
            self.kv.allocator.decref(seq.pages[keep:])
            del seq.pages[keep:]
            del seq.positions[n:]

    # ------------------------------------------------------------------ pred
    def pred(self, seq: KVSequence, tokens: TokenArray, positions: Optional[TokenArray] = None,
             *, all_logits: bool = False) -> torch.Tensor:
        return self.pred_batch([PredRequest(seq, tokens, positions, all_logits)])[0]

    def pred_batch(self, requests: Sequence[PredRequest],
                   checked: Optional[Sequence[tuple[list[int], list[int]]]] = None) -> list[torch.Tensor]:
        """Run many pred() calls as one forward pass; results in request order.

        ``checked``: the (tokens, positions) lists `validate` already returned for
        these requests, in order, so a caller that validated first (KVFS) does
        not pay for it twice."""
        if not requests:
            return []
        with self._lock:
            if checked is None:
                calls = [self.validate(i, r) for i, r in enumerate(requests)]
            else:
                if len(checked) != len(requests):
                    raise PredError("checked must hold one (tokens, positions) pair per request")
                calls = list(checked)
            if len({id(r.seq) for r in requests}) != len(requests):
                raise PredError("the same KV sequence appears twice in one batch")
            n_tokens = sum(len(t) for t, _ in calls)
            if n_tokens > self.config.max_batch_tokens:
                raise PredError(f"batch carries {n_tokens} tokens, more than max_batch_tokens="
                                f"{self.config.max_batch_tokens}")
            plans = self._reserve_pages(requests, calls)
            try:
                t0 = time.perf_counter()
                if self._graph_step(requests, calls, plans):
                    logits = self._decode_step(requests, calls, plans)   # [B, vocab]
                else:
                    meta = self._build_meta(requests, calls, plans)
                    logits = self.model.forward(meta, self.kv)          # [R, vocab]
                dt = time.perf_counter() - t0
            except BaseException:
                for plan in plans:                                  # roll back: sequences untouched
                    self.kv.allocator.decref(plan.fresh)
                raise
            out, row = [], 0
            for r, (toks, pos), plan in zip(requests, calls, plans):
                r.seq.pages = plan.pages
                r.seq.positions.extend(pos)
                if plan.replaced is not None:                       # copied-on-write
                    self.kv.allocator.decref([plan.replaced])
                n = len(toks) if r.all_logits else 1
                out.append(logits[row:row + n] if r.all_logits else logits[row])
                row += n
            s = self.stats
            s.forward_passes += 1
            s.pred_calls += len(requests)
            s.tokens += n_tokens
            s.forward_seconds += dt
            s.max_batch_calls = max(s.max_batch_calls, len(requests))
            s.batch_sizes[len(requests)] = s.batch_sizes.get(len(requests), 0) + 1
            return out

    # ------------------------------------------------------------------ helpers
    def validate(self, i: int, r: PredRequest) -> tuple[list[int], list[int]]:
        """Check one call without running it; returns (tokens, positions) as
        lists, or raises `PredError`.  ``i`` numbers the call in messages."""
        where = f"pred call {i}: " if i else "pred: "
        if not isinstance(r.seq, KVSequence):
            raise PredError(f"{where}kv must be a KVSequence, got {type(r.seq).__name__}")
        toks = _as_int_list(r.tokens, where + "tokens")
        if not toks:
            raise PredError(f"{where}tokens is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in toks if not 0 <= t < vocab), None)
        if bad is not None:
            raise PredError(f"{where}token id {bad} is out of the vocabulary [0, {vocab})")
        if r.positions is None:
            start = r.seq.next_position
            pos = list(range(start, start + len(toks)))
        else:
            pos = _as_int_list(r.positions, where + "positions")
            if len(pos) != len(toks):
                raise PredError(f"{where}{len(pos)} positions given for {len(toks)} tokens")
        ctx = self.model_config.max_context
        badp = next((p for p in pos if not 0 <= p < ctx), None)
        if badp is not None:
            raise PredError(f"{where}position {badp} is outside the model's context [0, {ctx})")
        if r.seq.length + len(toks) > self.max_seq_len:
            raise PredError(f"{where}the KV sequence would hold {r.seq.length + len(toks)} tokens, "
                            f"more than the limit {self.max_seq_len}")
        if not isinstance(r.all_logits, bool):
            raise PredError(f"{where}all_logits must be a bool")
        return toks, pos

    def _reserve_pages(self, requests, calls) -> list["_PagePlan"]:
        """New page tables for every request: pages appended, a shared partial
        last page replaced by a private copy.  All-or-nothing."""
        S, alloc = self.page_size, self.kv.allocator
        need = []
        for r, (toks, _) in zip(requests, calls):
            n_old, n_new = len(r.seq.pages), self.kv.pages_for(r.seq.length + len(toks))
            cow = r.seq.length % S != 0 and alloc.refcount(r.seq.pages[-1]) > 1
            need.append((n_new - n_old, cow))
        total = sum(k + c for k, c in need)
        if not alloc.can_allocate(total):
            raise OutOfPages(f"pred needs {total} KV pages, only {alloc.num_free} free")
        plans = []
        for r, (k, cow) in zip(requests, need):
            pages, fresh, replaced = list(r.seq.pages), [], None
            if cow:
                fresh = alloc.allocate(1)
                self.kv.copy_page(pages[-1], fresh[0], r.seq.length % S)
                replaced, pages[-1] = pages[-1], fresh[0]
            added = alloc.allocate(k)
            pages.extend(added)
            plans.append(_PagePlan(pages, fresh + added, replaced))
        return plans

    def _graph_step(self, requests, calls, plans) -> bool:
        """A decode step (one token per call, last logits only) the graphs can run."""
        return (self.graphs is not None
                and all(len(t) == 1 and not r.all_logits for r, (t, _) in zip(requests, calls))
                and self.graphs.fits(len(requests), max(len(p.pages) for p in plans)))

    def _decode_step(self, requests, calls, plans) -> torch.Tensor:
        tables = [p.pages for p in plans]
        slots, kv_lens = decode_step(tables, [r.seq.length for r in requests], self.page_size)
        self.stats.graph_steps += 1
        return self.graphs.run([t[0] for t, _ in calls], [p[0] for _, p in calls], slots,
                               tables, kv_lens)

    def _build_meta(self, requests, calls, plans) -> BatchMeta:
        S = self.page_size
        tokens, positions, slots, cu, kv_lens, rows = [], [], [], [0], [], []
        max_pages = max(len(p.pages) for p in plans)
        table = []
        for r, (toks, pos), plan in zip(requests, calls, plans):
            pages, base = plan.pages, r.seq.length
            tokens.extend(toks)
            positions.extend(pos)
            slots.extend(pages[j // S] * S + j % S for j in range(base, base + len(toks)))
            start = cu[-1]
            cu.append(start + len(toks))
            kv_lens.append(base + len(toks))
            rows.extend(range(start, cu[-1]) if r.all_logits else (cu[-1] - 1,))
            table.append(pages + [0] * (max_pages - len(pages)))
        dev = self.device
        i64, i32 = torch.int64, torch.int32
        return BatchMeta(
            tokens=torch.tensor(tokens, dtype=i64, device=dev),
            positions=torch.tensor(positions, dtype=i64, device=dev),
            slots=torch.tensor(slots, dtype=i64, device=dev),
            page_table=torch.tensor(table, dtype=i32, device=dev),
            cu_q_lens=torch.tensor(cu, dtype=i32, device=dev),
            kv_lens=torch.tensor(kv_lens, dtype=i32, device=dev),
            logit_rows=torch.tensor(rows, dtype=i64, device=dev),
            # one prompt into an empty file: plain causal attention over the new K/V
            fresh_prefill=len(requests) == 1 and requests[0].seq.length == 0 and len(tokens) > 1)


@dataclass
class _PagePlan:
    pages: list[int]            # the sequence's page table after the call
    fresh: list[int]            # pages allocated for it (released on failure)
    replaced: Optional[int]     # shared page swapped for a private copy (released on success)


def _as_int_list(x, what: str) -> list[int]:
    """A 1-D sequence of integers as a list; anything else is a PredError."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
            raise PredError(f"{what} must be a 1-D integer tensor, got {x.dtype} of shape {tuple(x.shape)}")
        return x.tolist()
    if isinstance(x, np.ndarray):
        if x.ndim != 1 or x.dtype.kind not in "iu":
            raise PredError(f"{what} must be a 1-D integer array, got {x.dtype} of shape {x.shape}")
        return x.tolist()
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        raise PredError(f"{what} must be a sequence of ints, got {type(x).__name__}")
    out = []
    for t in x:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise PredError(f"{what} must hold ints, got {type(t).__name__} {t!r}")
        out.append(int(t))
    return out
