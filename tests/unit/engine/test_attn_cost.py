"""What reading a key costs the attention, in query-key pairs (engine/attn_cost.py): solved
from two timings of the kernel; a kernel of known cost gives its ratio back."""
import pytest
import torch

from conftest import tiny_config
from symphony.engine.attn_cost import MAX_READ_PAIRS, read_pairs
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine
from symphony.engine.weights import random_weights


def kernel_of(read: float, per_kpair_s: float):
    """An attention "kernel" of known cost, per_kpair_s x (pairs + read x reads), pairs and reads
    in thousands, which checks what it is given and adds its cost to ``spent``; and a `measure`
    that reports that cost (the timing itself is the engine test's: a virtual machine's clocks
    are too lumpy to time a busy loop to the ratio's precision)."""
    spent = [0.0]

    def attend(q, k, v, table, cu, kv_lens, scale):
        n, ctx = q.shape[0], int(kv_lens[0])
        assert k.shape == v.shape and int(cu[-1]) == n and table.shape[1] * k.shape[1] >= ctx
        spent[0] += per_kpair_s * (n * (ctx - (n - 1) / 2) + read * ctx) / 1000
        return q

    def measure(fns):
        out = {}
        for key, fn in fns.items():
            spent[0] = 0.0
            fn()
            out[key] = [spent[0]]
        return out
    return attend, measure


@pytest.mark.parametrize("read", [0.0, 0.5, 4.0, 20.0])
def test_a_kernel_of_known_cost_gives_its_ratio_back(read):
    attend, measure = kernel_of(read, 2e-4)
    got = read_pairs(attend, 4, torch.zeros(2, 16, 2, 64), n_layers=1, measure=measure)
    assert got == pytest.approx(read, abs=0.02)


def test_a_kernel_that_costs_only_its_reading_and_bad_arguments():
    flat = lambda q, k, v, table, cu, kv_lens, scale: q                  # noqa: E731
    same = lambda fns: {k: [0.001] for k in fns}                         # noqa: E731
    assert read_pairs(flat, 4, torch.zeros(2, 16, 2, 64), n_layers=1, measure=same) == MAX_READ_PAIRS
    for kw in (dict(n_heads=0), dict(n_layers=0), dict(rounds=0), dict(layer_cache=torch.zeros(2, 16, 64))):
        args = dict(attend=flat, n_heads=4, layer_cache=torch.zeros(2, 16, 2, 64), n_layers=1) | kw
        with pytest.raises(ValueError):
            read_pairs(**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_own_kernel_is_timed_on_its_shapes(dtype):
    """The real paged attention kernel on the tiny model's caches: a reading costs something, and
    a query more than nothing (a finite ratio); the pool itself is not touched."""
    eng = Engine(random_weights(tiny_config(), seed=0), None, EngineConfig(page_size=16, num_pages=32, dtype=dtype))
    before = eng.kv.pool.clone()
    got = eng.attention_read_pairs()
    assert 0.0 < got < MAX_READ_PAIRS
    assert torch.equal(eng.kv.pool, before)
