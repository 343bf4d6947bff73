"""What reading a key costs the attention, in query-key pairs (engine/attn_cost.py): solved
from two timings of the kernel; a kernel of known cost gives its ratio back."""
import time

import pytest
import torch

from conftest import tiny_config
from symphony.engine.attn_cost import MAX_READ_PAIRS, read_pairs
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine
from symphony.engine.weights import random_weights


def kernel_of(read: float, per_kpair_s: float):
    """An attention "kernel" that takes per_kpair_s x (pairs + read x reads), pairs and reads
    in thousands, and checks what it is given."""
    def attend(q, k, v, table, cu, kv_lens, scale):
        n, ctx = q.shape[0], int(kv_lens[0])
        assert k.shape == v.shape and int(cu[-1]) == n and table.shape[1] * k.shape[1] >= ctx
        deadline = time.perf_counter() + per_kpair_s * (n * ctx + read * ctx) / 1000
        while time.perf_counter() < deadline:
            pass
        return q
    return attend


@pytest.mark.parametrize("read", [0.5, 4.0, 20.0])
def test_a_kernel_of_known_cost_gives_its_ratio_back(read):
    cache = torch.zeros(2, 16, 2, 64)
    got = read_pairs(kernel_of(read, 2e-4), 4, cache, n_layers=1, budget=2048 * 2 * 2 * 64 * 4)
    assert got == pytest.approx(read, rel=0.25, abs=0.3)


def test_a_kernel_that_costs_only_its_reading_and_bad_arguments():
    flat = lambda q, k, v, table, cu, kv_lens, scale: time.sleep(0.001)    # noqa: E731
    assert read_pairs(flat, 4, torch.zeros(2, 16, 2, 64), n_layers=1) == MAX_READ_PAIRS
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
