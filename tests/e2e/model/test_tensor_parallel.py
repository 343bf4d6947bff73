"""Tensor parallelism on the CPU (gloo), against one rank.

Rank 0 is this test process (`TensorParallel.start` spawns the other ranks as
worker processes; `Engine.close` stops them); the reference is the same file
loaded whole (--tp 1).  Tolerances, as a share of the largest |logit|:

  * float32 weights: 1e-4 (the row-parallel sums are added in another order);
  * quantized weights: 3e-3.  The CPU's quantized kernels round each row of
    activations to 15 bits of its own largest value (engine/quant.py: ~3e-5 of
    |x| |W|); a rank's row is its slice of the columns, so its rounding differs
    from the whole row's, within the kernel's stated accuracy.

Covered: mixed prefill / decode batches at --tp 4 on float weights (2 KV
heads replicated over 4 ranks) and --tp 2 on Q4_0 weights (KV heads split), the
embedded SmolLM2 at --tp 3, every KVFS page operation at --tp 2 (fork,
copy-on-write, truncate, extract, merge, a swap round trip through the host
and disk tiers, a suspension), durable files written at one size and read at
another, and sizes that cannot split the model refused with the ones that can.
"""
from __future__ import annotations

import torch
import pytest

from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine, PredRequest
from symphony.engine.loader import load_model, read_model_config
from symphony.engine.tp import Shard, TPConfigError, check_tp, shard_weights, valid_sizes
from symphony.engine.tp.launch import TensorParallel
from symphony.kvfs import KVFS, KVFSConfig, Principal

from modelfiles import hf_state_dict, tiny_hf_config, write_gguf

FLOAT_TOL, QUANT_TOL = 1e-4, 3e-3
ALICE = Principal("alice", 1)
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def tiny_file(tmp_path, quant=None, **over):
    cfg = tiny_hf_config(**over)
    return write_gguf(tmp_path / f"tiny-{quant}.gguf", cfg, hf_state_dict(cfg, seed=3), quant=quant)


@pytest.fixture
def engines():
    """``make(path, tp, **config)``: an engine of ``tp`` ranks; all closed at teardown."""
    made = []

    def make(path, tp=1, **over):
        cfg = EngineConfig(page_size=4, num_pages=48, **over)
        if tp == 1:
            weights, tok = load_model(path, progress=False, keep_quantized=cfg.keep_quantized)
            made.append(Engine(weights, tok, cfg))
        else:
            t = TensorParallel.start(path, cfg, tp, read_model_config(path), threads=1, timeout_s=30)
            try:
                made.append(Engine.load(path, cfg, progress=False, tp=t))
            except BaseException:
                t.close(0)
                raise
        return made[-1]
    yield make
    for e in made:
        e.close()


def toks(n, seed=0, vocab=200):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def mixed_batches(eng) -> list[torch.Tensor]:
    """Three steps of mixed prefill and decode over three sequences."""
    a, b, c = eng.new_sequence(), eng.new_sequence(), eng.new_sequence()
    out = eng.pred_batch([PredRequest(a, toks(13, 1), all_logits=True), PredRequest(b, toks(5, 2))])
    out += eng.pred_batch([PredRequest(a, [7]), PredRequest(b, toks(3, 4), all_logits=True),
                           PredRequest(c, toks(9, 5))])
    out += eng.pred_batch([PredRequest(a, [8]), PredRequest(b, [9]), PredRequest(c, [10])])
    return out


def assert_close(got, want, tol):
    for g, w in zip(got, want):
        scale = w.abs().max().item()
        err = (g - w).abs().max().item()
        assert err <= tol * scale, f"max |diff| {err:.3g} > {tol} x {scale:.3g}"


@pytest.mark.parametrize("tp", [4])
def test_float_ranks_give_the_logits_of_one(tmp_path, engines, tp):
    path = tiny_file(tmp_path)
    want = mixed_batches(engines(path))
    assert_close(mixed_batches(engines(path, tp)), want, FLOAT_TOL)


def test_ranks_keep_a_bfloat16_pool_as_one_engine_does(tmp_path, engines):
    """``kv_dtype`` travels to every rank (each rounds its heads' K and V alike)."""
    path = tiny_file(tmp_path)
    want = mixed_batches(engines(path, kv_dtype=torch.bfloat16))
    eng = engines(path, 2, kv_dtype=torch.bfloat16)
    assert eng.kv.dtype == torch.bfloat16
    assert_close(mixed_batches(eng), want, FLOAT_TOL)


@pytest.mark.parametrize("quant,tp", [("Q4_0", 2)])
def test_quantized_ranks_give_the_logits_of_one(tmp_path, engines, quant, tp):
    path = tiny_file(tmp_path, quant, **WIDE)                 # 4 query heads of 32: 2 KV heads, replicated at 4
    ref = engines(path)
    want = mixed_batches(ref)
    eng = engines(path, tp)
    assert eng.model.w.is_quantized() and eng.model.config.n_kv_heads == 1
    assert_close(mixed_batches(eng), want, QUANT_TOL)


def test_the_embedded_model_at_three_ranks(engines):
    ref = engines(None)
    want = mixed_batches(ref)
    eng = engines(None, 3)
    assert eng.model.config.n_heads == 3 and eng.model.config.n_kv_heads == 1
    got = mixed_batches(eng)
    assert_close(got, want, QUANT_TOL)           # (greedy text through the kernel: test_tp_kernel.py)


def test_sizes_that_do_not_split_are_refused_with_those_that_do():
    cfg = read_model_config(None)                             # 9 query heads, 3 KV heads
    with pytest.raises(TPConfigError, match=r"9 query heads do not split into 2; sizes that work: 1, 3"):
        check_tp(cfg, 2)
    assert valid_sizes(cfg) == [1, 3]
    check_tp(cfg, 3)


def test_each_rank_reads_its_shard_of_the_file(tmp_path):
    path = tiny_file(tmp_path, "Q8_0", **WIDE)
    whole, _ = load_model(path, progress=False)
    for r in range(4):
        part, _ = load_model(path, progress=False, shard=Shard(r, 4))
        ref = shard_weights(whole, Shard(r, 4))
        for a, b in zip(part.layers, ref.layers):
            for n in ("wqkv", "wo", "w_gate_up", "w_down"):
                x, y = getattr(a, n), getattr(b, n)
                assert torch.equal(x.qs, y.qs) and torch.equal(x.scales, y.scales), (r, n)


# ------------------------------------------------------------------ KVFS on every rank
def kv_walk(fs: KVFS) -> list[torch.Tensor]:
    """Every page operation KVFS makes, each followed by a pred whose logits are compared."""
    out = []
    h = fs.create(ALICE, "/home/alice/a.kv")
    out.append(fs.pred(ALICE, h, toks(10, 1)))
    g = fs.fork(ALICE, h)                                     # shares pages; its next pred copies the last
    out.append(fs.pred(ALICE, g, toks(3, 2)))
    out.append(fs.pred(ALICE, h, toks(2, 3)))
    fs.truncate(ALICE, g, 6)
    out.append(fs.pred(ALICE, g, [5]))
    x = fs.extract(ALICE, h, [(0, 3), (5, 9)])
    out.append(fs.pred(ALICE, x, [6]))
    m = fs.merge(ALICE, [x, g])
    out.append(fs.pred(ALICE, m, [7]))
    assert fs.suspend(ALICE.pid) > 0                          # every page of the LIP off the device
    fs.swap_in_pid(ALICE.pid)
    out.append(fs.pred(ALICE, m, [8]))
    out.append(fs.pred(ALICE, h, [9]))
    fs.sync(ALICE, h)
    return out


def test_every_kv_operation_runs_on_every_rank_and_durable_files_move_between_sizes(tmp_path, engines):
    path = tiny_file(tmp_path)
    results = {}
    for tp in (1, 2):
        eng = engines(path, tp)
        fs = KVFS(eng, KVFSConfig(host_pages=4, swap_dir=str(tmp_path / f"swap{tp}"),
                                  durable_dir=str(tmp_path / f"durable{tp}")))
        results[tp] = kv_walk(fs)
        fs.close_all()
        eng.close()                                           # one group at a time in this process
    assert_close(results[2], results[1], FLOAT_TOL)
    # durable files hold every head: written at --tp 2 and read at --tp 1, written at 1 and read at 2
    def cont(tp, written):
        eng = engines(path, tp)
        fs = KVFS(eng, KVFSConfig(durable_dir=str(tmp_path / f"durable{written}")))
        assert fs.restore_report["restored"] == ["/home/alice/a.kv"], fs.restore_report
        out = fs.pred(ALICE, fs.open(ALICE, "/home/alice/a.kv", "rw"), [11])
        eng.close()
        return out
    want = cont(1, 1)
    assert_close([cont(1, 2), cont(2, 1)], [want, want], FLOAT_TOL)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA GPUs (NCCL)")
def test_two_gpus_give_the_logits_of_one(tmp_path):
    """--gpus 0,1: one rank per GPU over NCCL, bfloat16, against one GPU."""
    path = tiny_file(tmp_path)
    cfg = EngineConfig(device="cuda:0", page_size=4, num_pages=48)
    weights, tok = load_model(path, progress=False, keep_quantized=False)
    ref = Engine(weights, tok, cfg)
    want = mixed_batches(ref)
    t = TensorParallel.start(path, cfg, 2, read_model_config(path), devices=["cuda:0", "cuda:1"])
    eng = Engine.load(path, cfg, progress=False, tp=t)
    try:
        assert_close([g.float().cpu() for g in mixed_batches(eng)], [w.float().cpu() for w in want], 2e-2)
    finally:
        eng.close()
