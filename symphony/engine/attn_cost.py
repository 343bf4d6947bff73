"""What reading a key costs the attention kernel, in query-key pairs: measured on the device.

A call of n tokens after c cached ones reads the c + n keys' K/V rows once and computes n x c
query-key pairs (roughly), so its attention takes ``k * (pairs + read_pairs * reads)``.  One
token deep in a long prompt is all reading: on the 2-vCPU Xeon of perf/RESULTS.md, one thread,
SmolLM2's 30 layers over 2,800 keys take 11.4 ms for 1 token and 301 ms for 128 (a reading
worth ~4 tokens' pairs); on a GPU the reading is nearly all of a decode's attention.  The
scheduler's cost model (`sched.cost.StepCost`) needs that ratio to price a few tokens deep in a
prompt beside a decoder (`sched.share.deferred`), and cannot learn it from the steps it times:
in a stream of steps the keys read move with the fixed cost.

`read_pairs` times the model's own attention kernel (``attend``, the one the forward pass
calls) on caches of the model's shapes and dtype - as many layers as fit in ``budget`` bytes
(8 MiB: more than a core's own caches hold, though not a large shared L3, so the figure is a
little optimistic about reading: 3.9-5.9 against 6.3-7.3 at 96 MiB, the Xeon, one thread) -
for 1 and for 16 query tokens over the same keys, and solves the two timings for the ratio.
Samples are interleaved (on a CPU by `ops.timing.interleaved`: the calling thread's CPU time,
samples in which the thread team waited for a core set aside, as the kernel calibration does);
medians of at least 5 (fewer on a busy box); 30-300 ms at start-up on the thread that runs the model.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch

from symphony.sched.cost import attention_pairs, attention_reads

from .ops.timing import interleaved

MAX_READ_PAIRS = 1000.0     # a device on which a query costs nothing beside its reading
QUERIES = 16                # the wide sample: enough tokens for the kernel's tiled path


def read_pairs(attend: Callable, n_heads: int, layer_cache: torch.Tensor, n_layers: int,
               budget: int = 8 << 20, rounds: int = 5,
               measure: Optional[Callable[[dict], dict]] = None,
               q_dtype: Optional[torch.dtype] = None) -> float:
    """Query-key pairs that reading one key costs ``attend`` (`ops.paged_attention`'s
    signature) on caches shaped like ``layer_cache`` (one layer's K cache, [pages, page_size,
    n_kv_heads, head_dim], whose dtype and device the samples take; ``q_dtype``: the queries'
    dtype, default the cache's), within [0, MAX_READ_PAIRS].
    ``measure``: {"one": fn, "wide": fn} -> {key: [seconds a call]} (default: `_measure`)."""
    if rounds < 1 or n_heads < 1 or n_layers < 1 or layer_cache.dim() != 4:
        raise ValueError("read_pairs needs rounds, n_heads and n_layers >= 1 and a [pages, page, heads, dim] cache")
    _, page, kv_heads, head_dim = layer_cache.shape
    dtype, device = layer_cache.dtype, layer_cache.device
    row = 2 * kv_heads * head_dim * layer_cache.element_size()          # K and V of one key
    ctx = max(4 * QUERIES, min(2048, budget // (n_layers * row)) // page * page)
    layers = max(1, min(n_layers, budget // (ctx * row)))
    pages = ctx // page
    g = torch.Generator(device="cpu").manual_seed(0)
    caches = [tuple(torch.randn(pages + 1, page, kv_heads, head_dim, generator=g).to(device, dtype)
                    for _ in range(2)) for _ in range(layers)]
    table = torch.arange(1, pages + 1, dtype=torch.int32).view(1, -1).to(device)
    kv_lens = torch.tensor([ctx], dtype=torch.int32, device=device)
    scale = head_dim ** -0.5

    def sample(n: int) -> Callable[[], None]:
        q = torch.randn(n, n_heads, head_dim, generator=g).to(device, q_dtype or dtype)
        cu = torch.tensor([0, n], dtype=torch.int32, device=device)

        def run() -> None:
            for k, v in caches:
                attend(q, k, v, table, cu, kv_lens, scale)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return run

    got = (measure or (lambda fns: _measure(fns, device, rounds)))({"one": sample(1), "wide": sample(QUERIES)})
    t1, tw = got["one"], got["wide"]
    if not t1 or not tw:
        raise RuntimeError("the attention could not be timed: every sample waited for a core")
    t1, tw = statistics.median(t1), statistics.median(tw)
    p1, pw = attention_pairs(ctx - 1, 1), attention_pairs(ctx - QUERIES, QUERIES)
    reads = attention_reads(ctx - 1, 1)                                  # the same keys either way
    if tw <= t1:
        return MAX_READ_PAIRS
    per_pair = (tw - t1) / (pw - p1)
    return min(MAX_READ_PAIRS, max(0.0, (t1 / per_pair - p1) / reads))


def _measure(fns: dict, device: torch.device, rounds: int) -> dict:
    """Seconds a call of each of ``fns``: on a GPU wall time (each call ends synchronized), in
    alternating order; on a CPU the calling thread's CPU time by `interleaved`, samples in which
    the thread team waited for a core set aside, within 0.3 s (a busy box: fewer samples)."""
    if device.type != "cuda":
        got, _ = interleaved(fns, min_kept=rounds, max_rounds=4 * rounds,
                             limits=(float("inf"), time.perf_counter() + 0.3))
        return got
    out: dict = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for i in range(rounds):
        for k in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            t = time.perf_counter()
            fns[k]()
            out[k].append(time.perf_counter() - t)
    return out
