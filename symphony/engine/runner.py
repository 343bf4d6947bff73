"""The runner: one forward pass over the calls of a step, a result or an error per call.

    step = ModelStep([StepCall(pages=[3, 7], start=5, tokens=[11, 12], positions=[5, 6],
                               want=Want("sample", sampling=check_sampling(0.8, seed=1)))])
    out = engine.runner.run(step)            # StepOutput
    out.results[0].value                     # tensor([token]) on the engine's device

A step is plain data: per call the page table of its KV file (every page its
K/V occupies after the call, the last ones freshly given to it), the first slot
it writes (the file's length before), its tokens and RoPE positions, and what
it wants back.  The runner allocates nothing and shares nothing: whoever owns
the pages (KVFS in the kernel, `Engine`'s in-process sequences) hands over
page tables it may write, and keeps its own books after a successful step.
A tensor-parallel runner implements the same `run(ModelStep) -> StepOutput`
across ranks.

Whoever owns the pages plans a step, the runner runs it, the owner commits
(or undoes) what it planned: `run_planned(owner, runner, calls)` is that walk
for any owner with ``prepare(calls) -> plan`` (``plan.step`` the `ModelStep`),
``commit(plan, StepOutput) -> results`` and ``undo(plan)``: the engine's
in-process sequences and KVFS's in-process pred are walked by it, and the
kernel's step (kernel/syscall/calls/pred.py) makes the same three calls itself.

Validation happened when the call was submitted (`Engine.check_call`, through
`KVFS.check_pred`); the runner only asserts what would corrupt memory.  If the
batched forward pass raises, each call is run alone so that only the culprit
fails (its slots were never counted as written by its owner).  Masks, top-k
and sampling run on the device (`sampler`); nothing here waits for the device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

import numpy as np
import torch

from .graphs import DecodeGraphs, decode_step
from .kv_cache import KVPool
from .model import BatchMeta, PagedLlama
from .page_allocator import pages_for
from .sampler import SamplingParams, apply_mask, sample, top_k

OUTPUTS = ("logits", "topk", "sample", "argmax")   # = symphony.ipc.abi.OUTPUTS (tied by test_runner.py)


@dataclass(frozen=True)
class Want:
    """What a call gets back for each of its rows."""

    output: str = "logits"                  # one of OUTPUTS
    k: int = 20                             # top-k: how many
    mask: Optional[np.ndarray] = None       # [vocab] bool: tokens allowed (logits/topk/argmax/sample)
    sampling: SamplingParams = SamplingParams()


@dataclass
class StepCall:
    """One call of a step: where its K/V goes and what it wants."""

    pages: list[int]               # the file's page table after the call
    start: int                     # first slot written: the file's length before the call
    tokens: list[int]              # [n] token ids
    positions: list[int]           # [n] RoPE positions
    all_rows: bool = False         # a row for every token, not only the last
    want: Want = Want()


@dataclass
class ModelStep:
    """One forward pass: the calls, in order."""

    calls: list[StepCall]

    @property
    def tokens(self) -> int:
        return sum(len(c.tokens) for c in self.calls)


@dataclass
class CallResult:
    """``value`` by `Want.output`: logits [rows, vocab] (model dtype, float32 when
    masked); topk (log-probs [rows, k] float32, ids [rows, k] int32); argmax and
    sample: tokens [rows] int64.  Or ``error``."""

    value: Any = None
    error: Optional[BaseException] = None


@dataclass
class StepOutput:
    results: list[CallResult]          # one per call, in step order


@dataclass
class EngineStats:
    forward_passes: int = 0
    pred_calls: int = 0
    tokens: int = 0
    max_batch_calls: int = 0
    forward_seconds: float = 0.0
    graph_steps: int = 0                               # decode steps on the static (graph) path
    batch_sizes: dict = field(default_factory=dict)   # calls per pass -> count


class Runner:
    """Executes `ModelStep`s on one model and one KV pool."""

    def __init__(self, model: PagedLlama, kv: KVPool, graphs: Optional[DecodeGraphs],
                 max_batch_tokens: int, stats: EngineStats):
        self.model, self.kv, self.graphs = model, kv, graphs
        self.page_size = kv.page_size
        self.max_batch_tokens = max_batch_tokens
        self.stats = stats

    def run(self, step: ModelStep) -> StepOutput:
        """Run the step as one forward pass; a result or an error per call."""
        calls = step.calls
        if not calls:
            return StepOutput([])
        refused = self.refuse(step)
        if refused is not None:
            return refused
        try:
            t0 = time.perf_counter()
            logits = self._forward(calls)                 # [rows of all calls, vocab]
            dt = time.perf_counter() - t0
        except Exception as e:
            if len(calls) == 1:
                return StepOutput([CallResult(error=e)])
            # one call broke the pass: run each alone, so only the culprit fails
            return StepOutput([self.run(ModelStep([c])).results[0] for c in calls])
        self._count(calls, step.tokens, dt)
        # every unmasked argmax of the pass in one kernel (a launch and a few µs of host time each
        # otherwise: at 64 calls a pass, more than the pass itself on a GPU)
        plain = [c.want.output == "argmax" and c.want.mask is None for c in calls]
        ids = logits.argmax(-1) if sum(plain) > 1 else None               # [rows]
        results, row = [], 0
        for c, p in zip(calls, plain):
            n = len(c.tokens) if c.all_rows else 1
            try:
                results.append(CallResult(ids[row:row + n] if p and ids is not None
                                          else finish(logits[row:row + n], c.want)))
            except Exception as e:
                results.append(CallResult(error=e))
            row += n
        return StepOutput(results)

    def refuse(self, step: ModelStep) -> Optional[StepOutput]:
        """An error for every call of a step over the token budget (None: it may run); asserts what
        would write outside a call's pages."""
        if step.tokens > self.max_batch_tokens:
            err = ValueError(f"step carries {step.tokens} tokens, more than max_batch_tokens="
                             f"{self.max_batch_tokens}")
            return StepOutput([CallResult(error=err) for _ in step.calls])
        for c in step.calls:                              # what would write outside the call's pages
            assert len(c.tokens) == len(c.positions) > 0, "a call needs tokens, one position each"
            assert len(c.pages) >= pages_for(c.start + len(c.tokens), self.page_size), \
                "page table too short for the call"
        return None

    # ------------------------------------------------------------------ helpers
    def _forward(self, calls: list[StepCall]) -> torch.Tensor:
        if (self.graphs is not None and all(len(c.tokens) == 1 and not c.all_rows for c in calls)
                and self.graphs.fits(len(calls), max(len(c.pages) for c in calls))):
            tables = [c.pages for c in calls]
            slots, kv_lens = decode_step(tables, [c.start for c in calls], self.page_size)
            self.stats.graph_steps += 1
            return self.graphs.run([c.tokens[0] for c in calls], [c.positions[0] for c in calls],
                                   slots, tables, kv_lens)                 # [B, vocab]
        return self.model.forward(self._build_meta(calls), self.kv)       # [R, vocab]

    def _build_meta(self, calls: list[StepCall]) -> BatchMeta:
        S = self.page_size
        tokens, positions, slots, cu, kv_lens, rows = [], [], [], [0], [], []
        max_pages = max(len(c.pages) for c in calls)
        table = []
        for c in calls:
            pages, base = c.pages, c.start
            tokens.extend(c.tokens)
            positions.extend(c.positions)
            slots.extend(pages[j // S] * S + j % S for j in range(base, base + len(c.tokens)))
            start = cu[-1]
            cu.append(start + len(c.tokens))
            kv_lens.append(base + len(c.tokens))
            rows.extend(range(start, cu[-1]) if c.all_rows else (cu[-1] - 1,))
            table.append(pages + [0] * (max_pages - len(pages)))
        dev = self.kv.pool.device
        i64, i32 = torch.int64, torch.int32
        return BatchMeta(
            tokens=torch.tensor(tokens, dtype=i64, device=dev),           # [T]
            positions=torch.tensor(positions, dtype=i64, device=dev),     # [T]
            slots=torch.tensor(slots, dtype=i64, device=dev),             # [T]
            page_table=torch.tensor(table, dtype=i32, device=dev),        # [B, max_pages]
            cu_q_lens=torch.tensor(cu, dtype=i32, device=dev),            # [B + 1]
            kv_lens=torch.tensor(kv_lens, dtype=i32, device=dev),         # [B]
            logit_rows=torch.tensor(rows, dtype=i64, device=dev),         # [R]
            # one prompt into an empty file: plain causal attention over the new K/V
            fresh_prefill=len(calls) == 1 and calls[0].start == 0 and len(tokens) > 1)

    def _count(self, calls: list[StepCall], n_tokens: int, dt: float) -> None:
        s = self.stats
        s.forward_passes += 1
        s.pred_calls += len(calls)
        s.tokens += n_tokens
        s.forward_seconds += dt
        s.max_batch_calls = max(s.max_batch_calls, len(calls))
        s.batch_sizes[len(calls)] = s.batch_sizes.get(len(calls), 0) + 1


class PageOwner(Protocol):
    """Who owns the pages a step writes: plans a step, then commits or undoes it."""

    def prepare(self, calls: Sequence) -> Any: ...          # a plan whose ``step`` is a ModelStep
    def commit(self, plan: Any, out: StepOutput) -> list: ...
    def undo(self, plan: Any) -> None: ...


def run_planned(owner: PageOwner, runner: Runner, calls: Sequence) -> list:
    """One step: ``owner`` plans the calls' pages, ``runner`` runs the forward
    pass, ``owner`` commits what succeeded and undoes what failed.  If the
    runner itself raises, everything planned is undone before the error goes on."""
    plan = owner.prepare(calls)
    try:
        out = runner.run(plan.step)
    except BaseException:
        owner.undo(plan)
        raise
    return owner.commit(plan, out)


def finish(x: torch.Tensor, want: Want) -> Any:
    """A call's result from its logits rows ``x`` [rows, vocab], on x's device."""
    if want.output == "logits":
        return x if want.mask is None else apply_mask(x, want.mask)
    x = apply_mask(x, want.mask)                          # [rows, vocab] float32
    if want.output == "topk":
        return top_k(x, want.k)
    if want.output == "argmax":
        return x.argmax(-1)
    if want.output == "sample":
        return sample(x, want.sampling)
    raise ValueError(f"output must be one of {OUTPUTS}, got {want.output!r}")


__all__ = ["CallResult", "EngineStats", "ModelStep", "OUTPUTS", "PageOwner", "Runner", "StepCall",
           "StepOutput", "Want", "finish", "run_planned"]
