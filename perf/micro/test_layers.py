"""The decoder layer stack of the tiny random Llama (perf/make_gguf.py --shape tiny: 2 layers,
hidden 256, intermediate 512, 4 / 2 heads of 64) in one ``ops.llama_layers`` call, as
``PagedLlama.forward`` makes it on a float32 CPU, for each of make_gguf's types: a decode step
of 1 and of 8 sequences with 128 cached tokens each, and a 64-token prefill. Embedding and head
are not included; the qlinear path is the automatic one."""
from __future__ import annotations

import pytest
import torch

from symphony.engine import ops, quant
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine

PAGE = 16
CASES = {"decode1_ctx128": (1, 1, 128), "decode8_ctx128": (8, 1, 128), "prefill64": (1, 64, 64)}

_engines: dict = {}


def engine(path) -> Engine:
    if path not in _engines:
        _engines[path] = Engine.load(path, EngineConfig(page_size=PAGE, num_pages=8), progress=False)
    return _engines[path]


def stack_args(eng: Engine, batch: int, new: int, context: int) -> tuple:
    """``ops.llama_layers``'s arguments for ``batch`` sequences of ``context`` tokens whose last
    ``new`` are computed now (pages in shuffled order)."""
    m, c = eng.model, eng.model_config
    g = torch.Generator().manual_seed(0)
    per = -(-context // PAGE)
    pool = torch.randn(c.n_layers, 2, batch * per + 1, PAGE, c.n_kv_heads, c.head_dim, generator=g)
    table = torch.randperm(batch * per + 1, generator=g)[: batch * per].int().view(batch, per)
    pos = torch.arange(context - new, context)                         # [new]
    slots = torch.cat([table[b, pos // PAGE].long() * PAGE + pos % PAGE for b in range(batch)])
    tokens = torch.randint(0, c.vocab_size, (batch * new,), generator=g)
    x = quant.embedding(tokens, m.w.embed, torch.float32)              # [T, hidden]
    return (x, pos.repeat(batch), m.rope_table, pool, slots, table,
            torch.arange(0, batch * new + 1, new, dtype=torch.int32),
            torch.full((batch,), context, dtype=torch.int32), *m.layer_stack,
            c.n_heads, c.n_kv_heads, m.scale, c.rms_eps, quant.qlinear_path())


@pytest.mark.benchmark(group="layer_stack_tiny", min_rounds=3, max_time=0.25)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("qtype", ("Q4_0", "Q8_0", "Q4_K_M"))
def test_layer_stack(benchmark, tiny_gguf, qtype, case):
    eng = engine(tiny_gguf[qtype])
    assert eng.model.layer_stack is not None
    args = stack_args(eng, *CASES[case])
    out = benchmark(ops.llama_layers, *args)
    assert out.shape == args[0].shape and torch.isfinite(out).all()
