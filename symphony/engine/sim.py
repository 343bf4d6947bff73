"""A simulated device: the engine with everything real but the forward pass.

    symphony-kernel --device sim                  # the h200-1b profile
    symphony-kernel --device sim:h200-smollm2     # another named profile
    symphony-kernel --device sim:step_ms=1.5,call_us=9,token_us=4.75,kv_ns=11

A benchmark and test tool, never a default.  It lets anyone measure and fix what the kernel
costs beside a fast accelerator on a machine without one: on an H200 a decode step of the
1B shape takes 1.5-2.1 ms, and every microsecond the host spends per system call shows; on a
CPU the real forward pass (tens of ms) hides it.

Real: the model's config and tokenizer (read from the model file; no weights are read), the
KV page pool and its pages (allocated, shared, copied, swapped and made durable by whoever owns
them, as on any device), the runner's contract (`run(ModelStep) -> StepOutput`, a result or an
error per call, the token budget), and masks, top-k and sampling, done by the engine's own
sampler on the logits the pass returns.

Modelled: the forward pass.  A step of B calls feeding T tokens, whose decode calls read K keys
in all, takes ``step + call * B + token * (T - B) + kv * K`` seconds (`SimProfile`) from its start;
its thread does the pass's host-side work (below), then waits out the rest with the GIL released
(a sleep at 1 us of timer slack), as a host thread waits for a real device's asynchronous work.
A step whose host-side work alone overruns the model is counted (`SimRunner.overruns`).

The pass writes each token it feeds into its KV slot (the first 32-bit word of layer 0's K), and a row's logits are a fixed function of its token t, its position p and the token q
before it in its file (read back from the pool, so a wrong page table or a lost swap shows in
the output)::

    h = mix(t, p, q)                              # a 64-bit hash
    logits = NOISE[h % 16]                        # [vocab] float32, fixed random rows
    logits[target(h)] = max(NOISE) + 6            # the greedy token: an ordinary word token

so greedy text is reproducible, a sample is drawn from a real distribution, and batching
cannot change any row.  Where no logits are wanted (an unmasked argmax) the pass computes the
target alone, as a device's argmax kernel would: no [rows, vocab] tensor is built.

Profiles (`PROFILES`), fitted to the NVIDIA H200 figures in perf/RESULTS.md ("GPU"):

* ``h200-1b``: the Llama-3.2-1B shape in bfloat16 with CUDA graphs: 1.52 ms a batch-1 step,
  1.70 ms at 16, 2.09 ms at 64 (decode tok/s 657 / 9,433 / 30,602); a 2,000-token prompt in
  11 ms; attention bound by its bytes at long contexts (32 KB of K/V a key at ~3 TB/s).
* ``h200-smollm2``: SmolLM2-135M in bfloat16: ~1.25 ms a batch-1 step (the in-process loop's
  1.78 ms less its host work), ~1.7 ms at 64; attention as measured for its head shape (decode
  32 x 1 at a context of 1,000: 0.062 ms a layer, 30 layers); prefill estimated at 1 us a token.
"""
from __future__ import annotations

import ctypes
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from .config import ConfigError, EngineConfig, ModelConfig
from .engine import Engine, Sequences
from .kv_cache import KVPool
from .runner import CallResult, EngineStats, ModelStep, Runner, StepCall, StepOutput, finish

log = logging.getLogger("symphony.engine")

__all__ = ["PROFILES", "SimEngine", "SimProfile", "SimRunner", "parse_profile"]


@dataclass(frozen=True)
class SimProfile:
    """How long a simulated forward pass takes: ``step_s + call_s * calls + token_s * (tokens -
    calls) + kv_s * keys``, keys being the keys its decode calls read (a decode's attention reads
    every key of its file once; a prompt's, compute-bound, is in its per-token cost)."""

    name: str
    step_s: float          # fixed: launches, every weight read once
    call_s: float          # each call (sequence) of the step
    token_s: float         # each token fed beyond one a call (prefill)
    kv_s: float            # each key a query reads (attention)

    def __post_init__(self) -> None:
        for f in ("step_s", "call_s", "token_s", "kv_s"):
            v = getattr(self, f)
            if not isinstance(v, float) or not 0 <= v < 10:
                raise ConfigError(f"simulated device: {f} must be a number of seconds in [0, 10), got {v!r}")

    def step_time(self, calls: list[StepCall]) -> float:
        """Seconds the pass over ``calls`` takes."""
        tokens = keys = 0
        for c in calls:
            n = len(c.tokens)
            tokens += n
            if n == 1:
                keys += c.start + 1
        return self.step_s + self.call_s * len(calls) + self.token_s * (tokens - len(calls)) + self.kv_s * keys

    def describe(self) -> str:
        return (f"{self.name}: {self.step_s * 1e3:.3g} ms a step + {self.call_s * 1e6:.3g} us a call + "
                f"{self.token_s * 1e6:.3g} us a prefill token + {self.kv_s * 1e9:.3g} ns a key read")


PROFILES = {
    "h200-1b": SimProfile("h200-1b", step_s=1.51e-3, call_s=9.0e-6, token_s=4.75e-6, kv_s=11e-9),
    "h200-smollm2": SimProfile("h200-smollm2", step_s=1.25e-3, call_s=7.0e-6, token_s=1.0e-6, kv_s=58e-9),
}
DEFAULT_PROFILE = "h200-1b"
_UNITS = {"step_ms": ("step_s", 1e-3), "call_us": ("call_s", 1e-6), "token_us": ("token_s", 1e-6),
          "kv_ns": ("kv_s", 1e-9)}


def parse_profile(spec: str) -> SimProfile:
    """``sim``, ``sim:NAME`` (a key of `PROFILES`) or ``sim:step_ms=..,call_us=..,token_us=..,kv_ns=..``
    (any subset: the rest from the default profile).  ConfigError names what is wrong."""
    if not isinstance(spec, str) or not (spec == "sim" or spec.startswith("sim:")):
        raise ConfigError(f"--device: 'cpu', 'sim' or 'sim:PROFILE', got {spec!r}")
    rest = spec[4:]
    if not rest:
        return PROFILES[DEFAULT_PROFILE]
    if rest in PROFILES:
        return PROFILES[rest]
    if "=" not in rest:
        raise ConfigError(f"--device sim:{rest}: no such profile (profiles: {', '.join(PROFILES)}; or "
                          f"{','.join(k + '=N' for k in _UNITS)})")
    base = PROFILES[DEFAULT_PROFILE]
    fields = {f: getattr(base, f) for f, _ in _UNITS.values()}
    for part in rest.split(","):
        key, _, value = part.partition("=")
        if key not in _UNITS:
            raise ConfigError(f"--device sim: unknown setting {key!r} (settings: {', '.join(_UNITS)})")
        try:
            v = float(value)
        except ValueError:
            raise ConfigError(f"--device sim: {key} must be a number, got {value!r}") from None
        if not 0 <= v < 1e9:
            raise ConfigError(f"--device sim: {key} must be >= 0, got {value!r}")
        name, unit = _UNITS[key]
        fields[name] = v * unit
    return SimProfile("custom", **fields)


# ---------------------------------------------------------------------------------------- waiting
_slack = threading.local()


def wait_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter() >= deadline`` with the GIL released; the calling thread's
    timer slack is set to 1 us once (Linux: 50 us by default, which would blur a 1.5 ms step)."""
    if not getattr(_slack, "set", False):
        _slack.set = True
        try:
            ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)    # PR_SET_TIMERSLACK, ns
        except (OSError, AttributeError):
            pass
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left)


# ---------------------------------------------------------------------------------------- logits
_K1, _K2, _K3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9)
NOISE_ROWS = 16
_WORD = re.compile(r"^[\u0120\u2581 ][A-Za-z]{2,}$")     # a word after a space (BPE's Ġ, SentencePiece's ▁)


def mix(t: np.ndarray, p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """A 64-bit hash of (token, position, previous token), elementwise (splitmix64's finalizer)."""
    with np.errstate(over="ignore"):
        z = t.astype(np.uint64) * _K1 + p.astype(np.uint64) * _K2 + (q + 1).astype(np.uint64) * _K3
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def word_tokens(tokenizer, vocab: int) -> np.ndarray:
    """The ids a simulated greedy pass chooses from: word tokens that follow a space (readable
    text), or every id that is not special when the vocabulary has few of them."""
    special = set(tokenizer.special_ids) | set(tokenizer.eos_ids) if tokenizer is not None else set()
    ids = []
    if tokenizer is not None:
        ids = sorted(i for t, i in tokenizer._tok.get_vocab().items()
                     if i < vocab and i not in special and _WORD.match(t))
    if len(ids) < 256:
        ids = [i for i in range(vocab) if i not in special]
    return np.asarray(ids, dtype=np.int64)


class SimRunner(Runner):
    """`Runner.run`'s contract with a modelled forward pass (this module's docstring)."""

    def __init__(self, kv: KVPool, model: ModelConfig, tokenizer, profile: SimProfile,
                 max_batch_tokens: int, stats: EngineStats):
        super().__init__(None, kv, None, max_batch_tokens, stats)
        self.profile = profile
        self.vocab = model.vocab_size
        self.targets = word_tokens(tokenizer, model.vocab_size)                # [W] int64
        rng = np.random.default_rng(0)
        self.noise = (rng.standard_normal((NOISE_ROWS, self.vocab)) * 2.0).astype(np.float32)   # [16, vocab]
        self.peak = float(self.noise.max()) + 6.0
        # layer 0's K as int32 words: a slot's first word holds the token fed there. numpy, like
        # everything here: no OpenMP team to wake for a few hundred bytes
        k0 = kv.pool[0, 0]                        # [num_pages, page_size, n_kv_heads, head_dim]
        self.words = k0.view(-1).view(torch.int32).numpy()
        self.slot_words = model.n_kv_heads * model.head_dim * k0.element_size() // 4
        self.overruns = 0                         # steps whose host-side work outlasted the model

    def run(self, step: ModelStep) -> StepOutput:
        calls = step.calls
        if not calls:
            return StepOutput([])
        refused = self.refuse(step)
        if refused is not None:
            return refused
        t0 = time.perf_counter()
        deadline = t0 + self.profile.step_time(calls)
        h, rows = self._hashes(calls)                                         # [R] uint64, rows per call
        greedy = self.targets[(h % np.uint64(len(self.targets))).astype(np.int64)]   # [R] int64
        ids = torch.from_numpy(greedy)
        results, r = [], 0
        for c, n in zip(calls, rows):
            w = c.want
            try:
                if w.output == "argmax" and w.mask is None:
                    results.append(CallResult(ids[r:r + n]))
                else:
                    results.append(CallResult(finish(self.logits(h[r:r + n], greedy[r:r + n]), w)))
            except Exception as e:
                results.append(CallResult(error=e))
            r += n
        if time.perf_counter() > deadline:
            self.overruns += 1
        wait_until(deadline)
        self._count(calls, step.tokens, time.perf_counter() - t0)
        return StepOutput(results)

    def logits(self, h: np.ndarray, greedy: np.ndarray) -> torch.Tensor:
        """The rows of hashes ``h`` [rows]: [rows, vocab] float32."""
        x = self.noise[(h % np.uint64(NOISE_ROWS)).astype(np.int64)]         # [rows, vocab], a copy
        x[np.arange(len(h)), greedy] = self.peak
        return torch.from_numpy(x)

    def _hashes(self, calls: list[StepCall]) -> tuple[np.ndarray, list[int]]:
        """Write every fed token into its KV slot; the hash of each output row, and rows per call."""
        S = self.page_size
        slots, fed, t_out, p_out, q_out, prev, rows = [], [], [], [], [], [], []
        for c in calls:
            toks, start, pages = c.tokens, c.start, c.pages
            if len(toks) == 1:                    # decode: one slot, one row
                slots.append(pages[start // S] * S + start % S)
            else:
                slots.extend(pages[j // S] * S + j % S for j in range(start, start + len(toks)))
            fed.extend(toks)
            first = len(q_out)
            if c.all_rows:
                t_out.extend(toks)
                p_out.extend(c.positions)
                q_out.append(-1)
                q_out.extend(toks[:-1])
                rows.append(len(toks))
            else:
                t_out.append(toks[-1])
                p_out.append(c.positions[-1])
                q_out.append(toks[-2] if len(toks) > 1 else -1)
                rows.append(1)
            if q_out[first] == -1 and start > 0:  # the token before the call's first, in the pool
                j = start - 1
                prev.append((first, pages[j // S] * S + j % S))
        q = np.asarray(q_out, dtype=np.int64)
        words, w = self.words, self.slot_words
        if prev:                                  # read before writing (a call's own tokens come after)
            q[[i for i, _ in prev]] = words[np.asarray([s for _, s in prev], dtype=np.int64) * w]
        words[np.asarray(slots, dtype=np.int64) * w] = fed
        return mix(np.asarray(t_out, dtype=np.int64), np.asarray(p_out, dtype=np.int64), q), rows


class SimEngine(Engine):
    """An `Engine` whose runner is a `SimRunner`: the model file's config and tokenizer, a real KV
    pool on the host, and a modelled forward pass.  Tensor parallelism and CUDA graphs do not apply."""

    def __init__(self, model_config: ModelConfig, tokenizer, config: EngineConfig, profile: SimProfile):
        if config.torch_device.type != "cpu":
            raise ConfigError("a simulated device keeps its KV pool in host memory: its engine config's "
                              f"device must be 'cpu', got {config.device!r}")
        self._setup(model_config, tokenizer, config, None)
        self.simulated = True
        self.profile = profile
        self.model = None
        self.kv = KVPool(model_config, config)
        self.page_size = self.kv.page_size
        self.graphs = None
        self.runner = SimRunner(self.kv, model_config, tokenizer, profile, config.max_batch_tokens, self.stats)
        self.sequences = Sequences(self)
        log.info("engine ready: %s on a SIMULATED device (%s), %d KV pages of %d positions (%.1f MiB, %s)",
                 model_config.name or model_config.arch, profile.describe(), self.kv.num_pages, self.page_size,
                 self.kv.num_pages * self.kv.page_bytes / 2**20, self.dtype)

    @classmethod
    def load(cls, path: Union[str, Path, None] = None, config: EngineConfig = EngineConfig(),
             profile: Optional[SimProfile] = None, progress: bool = False) -> "SimEngine":
        """The model file's config and tokenizer (no weights) on a simulated device (`parse_profile`)."""
        from .loader import ModelLoadError, _gguf_reader, default_model_path, read_model_config
        from symphony.tokenizer import Tokenizer, TokenizerError
        src = default_model_path() if path is None else Path(path).expanduser()
        cfg = read_model_config(src)
        try:
            if src.is_dir():
                tok = Tokenizer.from_hf_dir(src)
            else:
                fields = _gguf_reader(src).fields

                def meta(key, default=None):
                    f = fields.get(key)
                    return default if f is None else f.contents()
                tok = Tokenizer.from_gguf_fields(meta, src)
        except TokenizerError as e:
            raise ModelLoadError(f"{src}: tokenizer: {e}") from None
        engine = cls(cfg, tok, config, profile or PROFILES[DEFAULT_PROFILE])
        engine.model_id = src.stem if src.suffix == ".gguf" else src.name
        return engine

    def calibrate_kernels(self):
        return None                               # no CPU kernels run the model
