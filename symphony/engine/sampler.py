"""What a pred call gets back, computed where the logits are: logit biases, masks,
top-k, greedy and sampled tokens.  Written once, used by the runner (every kernel pred)
and the CLI.

    params = check_sampling(temperature=0.8, top_p=0.9, top_k=40, seed=7, min_p=0.05)
    x = apply_bias(logits, (ids, values))      # [rows, vocab] float32, values added at the ids
    x = apply_mask(x, allowed)                 # [rows, vocab], -inf where not allowed
    toks = sample(x, params)                   # [rows] int64, on x's device
    logprobs, ids = top_k(x, 20)               # [rows, 20] float32, [rows, 20] int32

Nothing here synchronizes with the device on its own, except `sample` on the
CPU, which checks that every row is a distribution it can draw from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

# sampling parameters a pred(output="sample") may ask for: the ABI's bounds (symphony/ipc/abi.py),
# which the engine may not import (tests/test_layout.py); tests/test_ipc_schema.py keeps them equal
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 100.0


class SamplingError(ValueError):
    """Bad sampling parameters, or logits no token can be drawn from."""


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters (build them with `check_sampling`)."""

    temperature: float = 1.0       # 0: greedy
    top_p: float = 1.0             # nucleus: the smallest set of tokens holding top_p
    top_k: int = 0                 # 0: no top-k
    seed: Optional[int] = None     # None: a fresh random seed per call
    min_p: float = 0.0             # drop tokens less likely than min_p x the most likely one


def check_sampling(temperature=1.0, top_p=1.0, top_k=0, seed=None, min_p=0.0) -> SamplingParams:
    """Validate sampling parameters; `SamplingError` names the bad one."""
    t = temperature
    if not _number(t) or not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        raise SamplingError(f"temperature must be 0 (greedy) or a number in "
                            f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {t!r}")
    if not _number(top_p) or not 0 < top_p <= 1:
        raise SamplingError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if top_k is None:
        top_k = 0
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= 1 << 31:
        raise SamplingError(f"top_k must be an int >= 0 (0: no top-k), got {top_k!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise SamplingError(f"seed must be an int or null, got {seed!r}")
    if min_p is None:
        min_p = 0.0
    if not _number(min_p) or not 0 <= min_p <= 1:
        raise SamplingError(f"min_p must be a number in [0, 1] (0: off), got {min_p!r}")
    return SamplingParams(t, top_p, top_k, seed, float(min_p))


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def apply_bias(x: torch.Tensor, bias: Optional[tuple[np.ndarray, np.ndarray]]) -> torch.Tensor:
    """``x`` [rows, vocab] as float32 with ``bias`` = (token ids [n] int64, values [n]
    float32; ids unique) added to every row at those ids: a new tensor, ``x`` is not
    written.  ``bias`` None: ``x`` as float32."""
    if bias is None:
        return x.float()
    ids, values = bias
    x = x.float().clone()
    x[:, torch.from_numpy(ids).to(x.device)] += torch.from_numpy(values).to(x.device)
    return x


def apply_mask(x: torch.Tensor, allowed: Optional[np.ndarray]) -> torch.Tensor:
    """``x`` [rows, vocab] as float32, -inf where ``allowed`` [vocab] (bool) is False."""
    x = x.float()
    if allowed is None:
        return x
    return x.masked_fill(~torch.from_numpy(allowed).to(x.device), float("-inf"))


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row of ``x`` [rows, vocab]:
    (log-probabilities [rows, k] float32, token ids [rows, k] int32), best first."""
    lp, ids = torch.log_softmax(x.float(), dim=-1).topk(k, dim=-1)
    return lp, ids.to(torch.int32)


def sample(x: torch.Tensor, p: SamplingParams,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of ``x`` [rows, vocab] (masked logits, -inf where
    disallowed): [rows] int64.  In order (symphony.lip.sampling.Sampler's): temperature,
    top-k, top-p, min-p (tokens less likely than ``min_p`` times the row's most likely
    one dropped), a draw from what is left.  ``generator``: draw from it (a stream the
    caller keeps, as the CLI does) instead of one seeded from ``p.seed``."""
    if p.temperature == 0:
        return x.argmax(-1)
    x = x.float() / p.temperature                       # [rows, vocab]
    if 0 < p.top_k < x.shape[-1]:
        kth = x.topk(p.top_k, dim=-1).values[..., -1:]  # [rows, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)                    # [rows, vocab]
    if generator is None:
        generator = torch.Generator(device=x.device)
        if p.seed is not None:
            generator.manual_seed(p.seed & 0xFFFFFFFFFFFF)
        else:
            generator.seed()
    if x.device.type == "cpu":
        if bool((~torch.isfinite(probs).all(-1) | ~(probs.sum(-1) > 0)).any()):
            raise SamplingError("the logits give no valid distribution to sample from (non-finite "
                                "after temperature and masking): use another temperature, or argmax")
        if p.top_p < 1:                                 # draw among the nucleus only
            sp, si = nucleus(probs, p.top_p)
            sp = _min_p(sp, p.min_p)
            return si.gather(-1, torch.multinomial(sp, 1, generator=generator)).squeeze(-1)
        return torch.multinomial(_min_p(probs, p.min_p), 1, generator=generator).squeeze(-1)
    if p.top_p < 1:                                     # a device sorts the whole row fast
        sp, si = probs.sort(dim=-1, descending=True)
        sp = sp.masked_fill(sp.cumsum(-1) - sp >= p.top_p, 0)
        probs = torch.zeros_like(probs).scatter(-1, si, sp)
    probs = _min_p(probs, p.min_p)
    bad = ~torch.isfinite(probs).all(-1) | ~(probs.sum(-1) > 0)     # [rows]
    greedy = torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(probs.dtype)
    probs = torch.where(bad.unsqueeze(-1), greedy, torch.nan_to_num(probs, nan=0.0))  # no sync: greedy
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """``probs`` [rows, n] with every token less likely than ``min_p`` times its row's
    most likely one set to 0 (min-p sampling; 0: unchanged).  The draw renormalizes."""
    if min_p <= 0:
        return probs
    return probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0)


NUCLEUS_CANDIDATES = 1024   # the top tokens a CPU row's nucleus is looked for in first


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of most likely tokens of each row whose probability reaches
    ``top_p`` (top-p / nucleus sampling): (probabilities [rows, k], zero outside the
    set; their token ids [rows, k]).  The set is found among the NUCLEUS_CANDIDATES
    most likely tokens when they hold ``top_p`` in every row (a partial sort: a full
    sort of a 49,152-token row costs a CPU ~2 ms, the step's argmax a few µs), and
    by sorting the whole rows otherwise; either way the same set."""
    k = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    sp, si = probs.topk(k, dim=-1)                      # best first
    if k < probs.shape[-1] and not bool((sp.sum(-1) >= top_p).all()):
        sp, si = probs.sort(dim=-1, descending=True)
    return sp.masked_fill(sp.cumsum(-1) - sp >= top_p, 0), si


__all__ = ["MAX_TEMPERATURE", "MIN_TEMPERATURE", "NUCLEUS_CANDIDATES", "SamplingError", "SamplingParams",
           "apply_bias", "apply_mask", "check_sampling", "nucleus", "sample", "top_k"]
