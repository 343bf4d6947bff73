"""The engine: a model, its KV page pool and the runner, plus an in-process API.

    engine = Engine.load()                         # embedded SmolLM2 on the CPU
    kv = engine.new_sequence()
    logits = engine.pred(kv, tokenizer.encode("Hello"))   # [vocab] for the last token
    logits = engine.pred(kv, [logits.argmax().item()])    # appended after the end

In the kernel, KVFS owns the pages: the syscall thread's step has KVFS
prepare a `ModelStep`, runs it on `engine.runner` (`runner.run(ModelStep) ->
StepOutput`) and has KVFS commit it; a call's arguments are checked once, at
submission, by `check_call`.  The in-process API below is for tests,
benchmarks and the CLI: its sequences own private pages (a fork copies them;
sharing pages between files is KVFS's, with its one copy-on-write), and
`Sequences` plans and commits their steps the same way (`run_planned`).

``pred(kv, tokens, positions=None, all_logits=False)`` appends the tokens' K/V
to ``kv`` (RoPE positions ``positions``, by default continuing after the last
one), runs one forward pass and returns float32 next-token logits for the last
token (``[vocab]``), or for every token (``[n, vocab]``) with ``all_logits``.
`pred_batch` runs many such calls, on different sequences, mixed prefill and
decode, as ONE forward pass; a `PredRequest`'s ``want`` asks for another result
than logits (``Want("argmax")``: the greedy token ids, chosen on the device).  A call with bad arguments raises `PredError`
(or `OutOfPages`) before anything changes: no sequence is touched, no page is
taken; a failing forward pass changes nothing either.

The engine is not re-entrant: callers (the kernel's scheduler) serialize
calls; a lock makes concurrent misuse safe rather than fast.
"""
from __future__ import annotations

from pathlib import Path

import logging
import threading
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from .config import EngineConfig
from .graphs import DecodeGraphs
from .kv_cache import KVPool, KVSequence
from .model import PagedLlama
from .page_allocator import OutOfPages
from .runner import EngineStats, ModelStep, Runner, StepCall, StepOutput, Want, run_planned
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
    want: Want = Want()          # what comes back (default: float32 logits); Want("argmax"): token ids


class Engine:
    def __init__(self, weights: ModelWeights, tokenizer: Optional[Tokenizer] = None,
                 config: EngineConfig = EngineConfig(), tp=None):
        """``tp``: rank 0's `tp.launch.TensorParallel` when ``weights`` are rank 0's
        shard: the model runs on every rank (engine/tp/), ``model_config`` is the
        whole model's, and the KV pool's page operations reach every rank."""
        self._setup(weights.config if tp is None else tp.model, tokenizer, config, tp)
        weights = prepare_weights(weights, config.keep_quantized, config.quantize)
        self.model = PagedLlama(weights, self.device, self.dtype, config.use_float32_head,
                                tp=None if tp is None else tp.group)
        if tp is None:
            self.kv = KVPool(self.model_config, config)
        else:
            from .tp.kv import ShardedKVPool
            self.kv = ShardedKVPool(self.model_config, weights.config, config, tp.group)
        self.page_size = self.kv.page_size
        self.graphs: Optional[DecodeGraphs] = None
        if config.use_graphs and tp is None:          # (a step per rank: graphs are not captured)
            self.graphs = DecodeGraphs(self.model, self.kv, config.graph_max_batch,
                                       self.kv.pages_for(self.max_seq_len),
                                       capture=self.device.type == "cuda")
            self.graphs.capture()
        self.runner = Runner(self.model, self.kv, self.graphs, config.max_batch_tokens, self.stats)
        self.sequences = Sequences(self)      # the in-process sequences' pages (a PageOwner)
        log.info("engine ready: %s on %s/%s, %d KV pages of %d positions (%.1f MiB)",
                 self.model_config.name or self.model_config.arch, self.device, self.dtype,
                 self.kv.num_pages, self.page_size, self.kv.num_pages * self.kv.page_bytes / 2**20)

    def _setup(self, model_config, tokenizer: Optional[Tokenizer], config: EngineConfig, tp) -> None:
        """What every engine has before its model and KV pool: configs, tokenizer, limits, counters."""
        self.config = config
        self.tp = tp
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.max_seq_len = min(config.max_seq_len or model_config.max_context, model_config.max_context)
        self.stats = EngineStats()
        self._lock = threading.RLock()
        self.simulated = False            # a simulated device (engine/sim.py) says so

    @property
    def computes_on_host(self) -> bool:
        """Whether the forward pass computes on this host's CPU cores (not on a GPU, not on a
        simulated device, which leave them free)."""
        return self.device.type == "cpu" and not self.simulated

    @property
    def step_tokens(self) -> int:
        """Tokens a kernel step should carry by default: on a CPU a prefill token costs ~100x a
        decode step's share, so a small budget keeps every step (and every decoder) short; a
        device (or a simulated one) takes more."""
        return min(256 if self.computes_on_host else 2048, self.config.max_batch_tokens)

    @classmethod
    def load(cls, path=None, config: EngineConfig = EngineConfig(), progress: bool = True,
             tp=None) -> "Engine":
        """Load a model from disk (default: the embedded SmolLM2) and build an engine
        (``tp``: rank 0 of a tensor-parallel group reads only its shard)."""
        from .loader import default_model_path, load_model
        weights, tok = load_model(path, progress=progress, keep_quantized=config.keep_quantized,
                                  shard=None if tp is None else tp.shard)
        engine = cls(weights, tok, config, tp=tp)
        src = Path(path) if path is not None else default_model_path()
        engine.model_id = src.stem if src.suffix == ".gguf" else src.name   # what clients call the model
        return engine

    def calibrate_kernels(self):
        """With quantized weights on the CPU: install qlinear's automatic choices as measured on
        this CPU for the calling thread's torch thread count (`ops.calibrate.ensure`: from the
        cache or a calibration of a few seconds, 15 at most on a busy box; once per process and
        thread count) and log them and the kernels a matrix then takes by rows. Call it on the thread that runs the
        model. Returns the `ops.calibrate.Calibration`, or None (nothing to do)."""
        from .ops import calibrate
        from .quant import describe_cpu_kernels
        calib = calibrate.ensure_for(self.device, self.model.w.is_quantized())
        if calib is not None:
            log.info("quantized weights: %s", describe_cpu_kernels())
        return calib

    def attention_read_pairs(self) -> float:
        """What reading one key costs this device's attention, in query-key pairs (`attn_cost`:
        measured on caches of the model's shapes, 30-300 ms); 0 on a simulated device, whose
        passes read nothing. Call it on the thread that runs the model."""
        if self.simulated:
            return 0.0
        from .attn_cost import read_pairs
        c, k_cache = self.model.config, self.kv.layer(0)[0]
        heads = k_cache.shape[2] * (c.n_heads // c.n_kv_heads)     # a tensor-parallel rank's own
        return read_pairs(self.model.kernels.paged_attention, heads, k_cache, c.n_layers, q_dtype=self.dtype)

    def close(self) -> None:
        """Release what outlives the process's memory: the other tensor-parallel
        ranks are told to stop and waited for.  Idempotent."""
        self.kv.close()
        if self.tp is not None:
            self.tp.close()

    # ------------------------------------------------------------------ validation (once, at submission)
    def check_call(self, tokens: TokenArray, positions: Optional[TokenArray], *, length: int,
                   next_position: int, all_logits: bool = False,
                   where: str = "pred: ") -> tuple[list[int], Optional[list[int]]]:
        """Check one pred call on a file of ``length`` slots whose next default
        position is ``next_position``, without running it: (tokens, positions)
        as lists (positions None when defaulted), or `PredError`."""
        if (positions is None and type(tokens) is np.ndarray and tokens.shape == (1,)
                and tokens.dtype.kind in "iu" and type(all_logits) is bool):   # one token: every decode step
            t = int(tokens[0])
            if (0 <= t < self.model_config.vocab_size and 0 <= next_position < self.model_config.max_context
                    and length + 1 <= self.max_seq_len):
                return [t], None                    # (else the checks below say what is wrong)
        toks = _as_int_list(tokens, where + "tokens")
        if not toks:
            raise PredError(f"{where}tokens is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in toks if not 0 <= t < vocab), None)
        if bad is not None:
            raise PredError(f"{where}token id {bad} is out of the vocabulary [0, {vocab})")
        pos = None
        if positions is None:
            check = (next_position, next_position + len(toks) - 1)
        else:
            pos = _as_int_list(positions, where + "positions")
            if len(pos) != len(toks):
                raise PredError(f"{where}{len(pos)} positions given for {len(toks)} tokens")
            check = pos
        ctx = self.model_config.max_context
        badp = next((p for p in check if not 0 <= p < ctx), None)
        if badp is not None:
            raise PredError(f"{where}position {badp} is outside the model's context [0, {ctx})")
        if length + len(toks) > self.max_seq_len:
            raise PredError(f"{where}the KV sequence would hold {length + len(toks)} tokens, "
                            f"more than the limit {self.max_seq_len}")
        if not isinstance(all_logits, bool):
            raise PredError(f"{where}all_logits must be a bool")
        return toks, pos

    # ------------------------------------------------------------------ in-process sequences
    def new_sequence(self) -> KVSequence:
        return KVSequence()

    def release(self, seq: KVSequence) -> None:
        """Give the sequence's pages back."""
        with self._lock:
            self.kv.allocator.free(seq.pages)
            seq.pages, seq.positions = [], []

    def fork(self, seq: KVSequence) -> KVSequence:
        """A copy of the sequence in pages of its own (in-process sequences never
        share pages; KVFS's fork is the copy-on-write one)."""
        with self._lock:
            pages = self.kv.allocator.allocate(len(seq.pages))
            for src, dst in zip(seq.pages, pages):
                self.kv.copy_page(src, dst)
            return KVSequence(pages, list(seq.positions))

    def truncate(self, seq: KVSequence, n: int) -> None:
        """Keep the first ``n`` slots; pages past them are released."""
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= seq.length:
            raise PredError(f"truncate length must be an int in [0, {seq.length}], got {n!r}")
        with self._lock:
            keep = self.kv.pages_for(n)
            self.kv.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]
            del seq.positions[n:]

    def pred(self, seq: KVSequence, tokens: TokenArray, positions: Optional[TokenArray] = None,
             *, all_logits: bool = False) -> torch.Tensor:
        return self.pred_batch([PredRequest(seq, tokens, positions, all_logits)])[0]

    def pred_batch(self, requests: Sequence[PredRequest]) -> list[torch.Tensor]:
        """Run many pred() calls as one forward pass; results in request order.
        All or nothing: on any error no sequence changes and no page is kept.
        The walk is the kernel's: plan pages, run, commit or undo (`run_planned`)."""
        if not requests:
            return []
        with self._lock:
            return run_planned(self.sequences, self.runner, requests)

    def validate(self, i: int, r: PredRequest) -> tuple[list[int], list[int]]:
        """Check one in-process call: (tokens, positions) as lists, or `PredError`.
        ``i`` numbers the call in messages."""
        where = f"pred call {i}: " if i else "pred: "
        if not isinstance(r.seq, KVSequence):
            raise PredError(f"{where}kv must be a KVSequence, got {type(r.seq).__name__}")
        toks, pos = self.check_call(r.tokens, r.positions, length=r.seq.length,
                                    next_position=r.seq.next_position, all_logits=r.all_logits,
                                    where=where)
        if pos is None:
            pos = list(range(r.seq.next_position, r.seq.next_position + len(toks)))
        return toks, pos


@dataclass
class SequencePlan:
    """A step of in-process calls, planned: fresh pages given, not yet kept."""

    requests: Sequence[PredRequest]
    positions: list[list[int]]       # per call: its RoPE positions
    fresh: list[list[int]]           # per call: pages allocated for it
    step: ModelStep


class Sequences:
    """The in-process sequences' pages as the runner's `PageOwner`: `prepare`
    checks every call and allocates its new pages, `commit` keeps them (or
    gives them all back and raises the first error: all or nothing)."""

    def __init__(self, engine: "Engine"):
        self.engine = engine

    def prepare(self, requests: Sequence[PredRequest]) -> SequencePlan:
        e = self.engine
        calls = [e.validate(i, r) for i, r in enumerate(requests)]
        if len({id(r.seq) for r in requests}) != len(requests):
            raise PredError("the same KV sequence appears twice in one batch")
        n_tokens = sum(len(t) for t, _ in calls)
        if n_tokens > e.config.max_batch_tokens:
            raise PredError(f"batch carries {n_tokens} tokens, more than max_batch_tokens="
                            f"{e.config.max_batch_tokens}")
        alloc = e.kv.allocator
        need = [e.kv.pages_for(r.seq.length + len(t)) - len(r.seq.pages) for r, (t, _) in zip(requests, calls)]
        if not alloc.can_allocate(sum(need)):
            raise OutOfPages(f"pred needs {sum(need)} KV pages, only {alloc.num_free} free")
        fresh = [alloc.allocate(k) for k in need]
        step = ModelStep([StepCall(r.seq.pages + f, r.seq.length, t, p, r.all_logits, r.want)
                          for r, (t, p), f in zip(requests, calls, fresh)])
        return SequencePlan(requests, [p for _, p in calls], fresh, step)

    def commit(self, plan: SequencePlan, out: StepOutput) -> list[torch.Tensor]:
        err = next((o.error for o in out.results if o.error is not None), None)
        if err is not None:                                 # roll back: sequences untouched
            self.undo(plan)
            raise err
        for r, p, f in zip(plan.requests, plan.positions, plan.fresh):
            r.seq.pages.extend(f)
            r.seq.positions.extend(p)
        return [o.value if r.all_logits else _first_row(o.value) for r, o in zip(plan.requests, out.results)]

    def undo(self, plan: SequencePlan) -> None:
        self.engine.kv.allocator.free([p for f in plan.fresh for p in f])


def _first_row(value):
    """A one-row result without its row dimension (top-k: its log-probs and ids each)."""
    return tuple(v[0] for v in value) if isinstance(value, tuple) else value[0]


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
