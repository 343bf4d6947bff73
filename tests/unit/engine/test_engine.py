"""The paged engine against the plain PyTorch reference, on tiny random models."""
import numpy as np
import pytest
import torch

from conftest import HALF_TINY_ATOL, HALF_TINY_SAME_DTYPE_ATOL, TINY_ATOL, tiny_config
from symphony.engine.config import EngineConfig, RopeScaling
from symphony.engine.engine import Engine, PredError, PredRequest
from symphony.engine.page_allocator import OutOfPages
from symphony.engine.reference import ReferenceLlama
from symphony.engine.weights import random_weights


def make(cfg=None, pages=128, page_size=4, seed=0):
    cfg = cfg or tiny_config()
    w = random_weights(cfg, seed=seed)
    return Engine(w, None, EngineConfig(page_size=page_size, num_pages=pages)), ReferenceLlama(w)


def rand_tokens(n, vocab=101, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(ref, tokens, positions=None):
    return ref.forward(tokens, positions)


@pytest.mark.parametrize("cfg", [
    tiny_config(),
    tiny_config(n_kv_heads=4),                                         # MHA
    tiny_config(n_heads=6, n_kv_heads=2, head_dim=8, hidden_size=48),  # GQA 3:1, like SmolLM2
    tiny_config(arch="qwen2", attn_bias=True),
    tiny_config(rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64), rope_theta=500000.0),
    tiny_config(rope_scaling=RopeScaling("linear", 2.0)),
], ids=["gqa2", "mha", "gqa3", "qwen2-bias", "llama3-rope", "linear-rope"])
def test_single_sequence_chunks_match_reference(cfg):
    eng, ref = make(cfg)
    toks = rand_tokens(40)
    want = reference_logits(ref, toks)                               # [40, vocab]
    kv = eng.new_sequence()
    got, at = [], 0
    for n in (1, 7, 16, 3, 1, 1, 5, 6):                              # prefill chunks and decodes
        got.append(eng.pred(kv, toks[at:at + n], all_logits=True))
        at += n
    got = torch.cat(got)
    assert kv.length == 40 and kv.positions == list(range(40))
    torch.testing.assert_close(got, want, atol=TINY_ATOL, rtol=0)
    last = eng.pred(eng.new_sequence(), toks)                         # default: last token only
    assert last.shape == (101,)
    torch.testing.assert_close(last, want[-1], atol=TINY_ATOL, rtol=0)


def test_mixed_batch_matches_reference_and_members_alone():
    eng, ref = make(pages=256)
    alone, _ = make(pages=256)
    hist = {i: rand_tokens(n, seed=i) for i, n in enumerate((1, 9, 17, 30))}
    seqs, solo = [], []
    for i, toks in hist.items():                                     # different existing lengths
        s, t = eng.new_sequence(), alone.new_sequence()
        eng.pred(s, toks[:-1] or toks)
        alone.pred(t, toks[:-1] or toks)
        seqs.append(s), solo.append(t)
    new = [[5], rand_tokens(6, seed=10), [7], rand_tokens(13, seed=11)]   # decode + prefill mixed
    reqs = [PredRequest(s, n, all_logits=(i % 2 == 1)) for i, (s, n) in enumerate(zip(seqs, new))]
    out = eng.pred_batch(reqs)
    assert eng.stats.max_batch_calls == 4
    for i, (toks, n) in enumerate(zip(hist.values(), new)):
        full = (toks[:-1] or toks) + n
        want = reference_logits(ref, full)[-len(n):]
        want = want if i % 2 == 1 else want[-1]
        torch.testing.assert_close(out[i], want, atol=TINY_ATOL, rtol=0)
        solo_out = alone.pred(solo[i], n, all_logits=(i % 2 == 1))
        torch.testing.assert_close(out[i], solo_out, atol=1e-5, rtol=0)


def test_explicit_positions_match_reference():
    eng, ref = make()
    toks = rand_tokens(12)
    pos = [3, 4, 5, 6, 20, 21, 22, 23, 24, 100, 101, 102]
    kv = eng.new_sequence()
    got = torch.cat([eng.pred(kv, toks[:4], pos[:4], all_logits=True),
                     eng.pred(kv, toks[4:], pos[4:], all_logits=True)])
    assert kv.positions == pos and kv.next_position == 103
    torch.testing.assert_close(got, reference_logits(ref, toks, pos), atol=TINY_ATOL, rtol=0)


def test_fork_copies_pages_and_each_side_matches_reference():
    """In-process sequences never share pages (sharing, with its copy-on-write,
    is KVFS's: test_kvfs.py::test_fork_shares_pages_and_both_sides_match)."""
    eng, ref = make(page_size=4)
    base = rand_tokens(10)                                   # 2 full pages + a partial one
    a = eng.new_sequence()
    eng.pred(a, base)
    used = eng.kv.allocator.num_used
    b = eng.fork(a)
    assert not set(b.pages) & set(a.pages) and eng.kv.allocator.num_used == 2 * used
    assert b.positions == a.positions and b.positions is not a.positions
    assert torch.equal(eng.kv.pool[:, :, b.pages], eng.kv.pool[:, :, a.pages])
    la = eng.pred(a, [1, 2])                                 # a writes into its own partial page
    assert eng.kv.allocator.num_used == 2 * used
    lb = eng.pred(b, [3, 4, 5])                              # b's 13th slot needs a fourth page
    assert eng.kv.allocator.num_used == 2 * used + 1
    torch.testing.assert_close(la, reference_logits(ref, base + [1, 2])[-1], atol=TINY_ATOL, rtol=0)
    torch.testing.assert_close(lb, reference_logits(ref, base + [3, 4, 5])[-1], atol=TINY_ATOL, rtol=0)
    eng.release(a)
    eng.release(b)
    assert eng.kv.allocator.num_used == 0


def test_truncate_then_pred_matches_recompute():
    eng, ref = make(page_size=4)
    toks = rand_tokens(15)
    kv = eng.new_sequence()
    eng.pred(kv, toks)
    eng.truncate(kv, 6)
    assert kv.length == 6 and len(kv.pages) == 2 and eng.kv.allocator.num_used == 2
    got = eng.pred(kv, [9, 8, 7])
    torch.testing.assert_close(got, reference_logits(ref, toks[:6] + [9, 8, 7])[-1], atol=TINY_ATOL, rtol=0)
    with pytest.raises(PredError):
        eng.truncate(kv, 10)


BAD_CALLS = {
    "token out of vocab": (dict(tokens=[1, 101]), "out of the vocabulary"),
    "negative token": (dict(tokens=[-1]), "out of the vocabulary"),
    "empty tokens": (dict(tokens=[]), "empty"),
    "float tokens": (dict(tokens=[1.0, 2.0]), "must hold ints"),
    "bool tokens": (dict(tokens=[True]), "must hold ints"),
    "string tokens": (dict(tokens="hello"), "sequence of ints"),
    "2-D array": (dict(tokens=np.zeros((2, 2), dtype=np.int64)), "1-D integer array"),
    "float tensor": (dict(tokens=torch.zeros(3)), "1-D integer tensor"),
    "positions length": (dict(tokens=[1, 2], positions=[5]), "1 positions given for 2 tokens"),
    "position past context": (dict(tokens=[1], positions=[256]), "outside the model's context"),
    "negative position": (dict(tokens=[1], positions=[-3]), "outside the model's context"),
    "sequence too long": (dict(tokens=[1] * 250, positions=[0] * 250), "more than the limit"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS), ids=list(BAD_CALLS))
def test_bad_input_raises_and_changes_nothing(case):
    kwargs, msg = BAD_CALLS[case]
    eng, _ = make()
    kv = eng.new_sequence()
    eng.pred(kv, rand_tokens(10))
    before = (list(kv.pages), list(kv.positions), eng.kv.allocator.num_free)
    with pytest.raises(PredError, match=msg):
        eng.pred(kv, **kwargs)
    # a bad call inside a batch of good ones: nothing in the batch happens
    other = eng.new_sequence()
    with pytest.raises(PredError):
        eng.pred_batch([PredRequest(other, [1, 2, 3]), PredRequest(kv, **kwargs)])
    assert (list(kv.pages), list(kv.positions), eng.kv.allocator.num_free) == before
    assert other.length == 0 and other.pages == []


def test_same_sequence_twice_in_a_batch_is_refused():
    eng, _ = make()
    kv = eng.new_sequence()
    with pytest.raises(PredError, match="twice"):
        eng.pred_batch([PredRequest(kv, [1]), PredRequest(kv, [2])])
    assert kv.length == 0


def test_out_of_pages_is_atomic_and_recoverable():
    eng, ref = make(pages=6, page_size=4)                    # 5 usable pages = 20 slots
    a, b = eng.new_sequence(), eng.new_sequence()
    eng.pred(a, rand_tokens(12))                             # 3 pages
    with pytest.raises(OutOfPages):
        eng.pred_batch([PredRequest(b, [1, 2, 3]), PredRequest(a, rand_tokens(9, seed=3))])
    assert b.length == 0 and a.length == 12 and eng.kv.allocator.num_free == 2
    eng.release(a)
    got = eng.pred(b, rand_tokens(20, seed=4))               # everything fits again
    torch.testing.assert_close(got, reference_logits(ref, rand_tokens(20, seed=4))[-1], atol=TINY_ATOL, rtol=0)


def test_forward_failure_rolls_back(monkeypatch):
    eng, _ = make()
    kv = eng.new_sequence()
    eng.pred(kv, [1, 2, 3])
    free = eng.kv.allocator.num_free

    def boom(*a, **k):
        raise RuntimeError("device lost")
    monkeypatch.setattr(eng.model, "forward", boom)
    with pytest.raises(RuntimeError, match="device lost"):
        eng.pred(kv, list(range(20)))
    assert kv.length == 3 and eng.kv.allocator.num_free == free


def test_numpy_and_tensor_tokens_accepted():
    eng, ref = make()
    toks = rand_tokens(5)
    a = eng.pred(eng.new_sequence(), np.array(toks, dtype=np.int32))
    b = eng.pred(eng.new_sequence(), torch.tensor(toks))
    torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- bfloat16 / float16 on the CPU
HALF = [torch.bfloat16, torch.float16]
HALF_IDS = ["bf16", "fp16"]


def make_half(dtype, cfg=None, pages=128, page_size=4, seed=0):
    cfg = cfg or tiny_config()
    w = random_weights(cfg, seed=seed)
    eng = Engine(w, None, EngineConfig(page_size=page_size, num_pages=pages, dtype=dtype))
    return eng, ReferenceLlama(w), ReferenceLlama(w, dtype=dtype)


def close_half(got, ref32, ref_dtype, dtype):
    """Engine logits vs the float32 reference and vs the reference run in the dtype itself."""
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref32, atol=HALF_TINY_ATOL[dtype], rtol=0)
    torch.testing.assert_close(got, ref_dtype, atol=HALF_TINY_SAME_DTYPE_ATOL[dtype], rtol=0)


def test_engine_config_dtypes():
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert EngineConfig(dtype=dt).torch_dtype == dt
    assert EngineConfig().torch_dtype == torch.float32                 # the CPU default
    with pytest.raises(ValueError, match="dtype must be float32, float16 or bfloat16"):
        EngineConfig(dtype=torch.float64)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("cfg", [
    tiny_config(),
    tiny_config(n_kv_heads=4),
    tiny_config(n_heads=6, n_kv_heads=2, head_dim=8, hidden_size=48),
    tiny_config(arch="qwen2", attn_bias=True),
    tiny_config(rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64), rope_theta=500000.0),
], ids=["gqa2", "mha", "gqa3", "qwen2-bias", "llama3-rope"])
def test_half_chunks_match_reference(dtype, cfg):
    eng, ref32, refd = make_half(dtype, cfg)
    assert eng.kv.pool.dtype == dtype and eng.model.w.layers[0].wqkv.dtype == dtype
    assert eng.kv.page_bytes == 2 * cfg.n_layers * 4 * cfg.kv_size * 2    # 2 bytes an element
    toks = rand_tokens(40)
    kv = eng.new_sequence()
    got, at = [], 0
    for n in (1, 7, 16, 3, 1, 1, 5, 6):                                  # prefill chunks and decodes
        got.append(eng.pred(kv, toks[at:at + n], all_logits=True))
        at += n
    close_half(torch.cat(got), ref32.forward(toks), refd.forward(toks), dtype)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_half_mixed_batch_equals_members_alone(dtype):
    """Batching does not change the numbers: measured <= 4e-7 (the float32 head's summation
    order), so the tolerance is the float32 one."""
    eng, ref32, refd = make_half(dtype, pages=256)
    alone, _, _ = make_half(dtype, pages=256)
    hist = {i: rand_tokens(n, seed=i) for i, n in enumerate((1, 9, 17, 30))}
    seqs, solo = [], []
    for toks in hist.values():
        s, t = eng.new_sequence(), alone.new_sequence()
        eng.pred(s, toks[:-1] or toks)
        alone.pred(t, toks[:-1] or toks)
        seqs.append(s), solo.append(t)
    new = [[5], rand_tokens(6, seed=10), [7], rand_tokens(13, seed=11)]
    out = eng.pred_batch([PredRequest(s, n, all_logits=(i % 2 == 1))
                          for i, (s, n) in enumerate(zip(seqs, new))])
    assert eng.stats.max_batch_calls == 4
    for i, (toks, n) in enumerate(zip(hist.values(), new)):
        full = (toks[:-1] or toks) + n
        want32, wantd = ref32.forward(full)[-len(n):], refd.forward(full)[-len(n):]
        if i % 2 == 0:
            want32, wantd = want32[-1], wantd[-1]
        close_half(out[i], want32, wantd, dtype)
        torch.testing.assert_close(out[i], alone.pred(solo[i], n, all_logits=(i % 2 == 1)),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_half_fork_and_truncate(dtype):
    eng, ref32, refd = make_half(dtype, page_size=4)
    base = rand_tokens(10)
    a = eng.new_sequence()
    eng.pred(a, base)
    used = eng.kv.allocator.num_used
    b = eng.fork(a)
    la = eng.pred(a, [1, 2])                                  # writes its own copy of the partial page
    lb = eng.pred(b, [3, 4, 5])
    assert not set(a.pages) & set(b.pages)
    assert eng.kv.allocator.num_used == 2 * used + 1
    close_half(la, ref32.forward(base + [1, 2])[-1], refd.forward(base + [1, 2])[-1], dtype)
    close_half(lb, ref32.forward(base + [3, 4, 5])[-1], refd.forward(base + [3, 4, 5])[-1], dtype)
    # the fork's copy of the partial page is bit-exact in the slots both had
    k_a, k_b = eng.kv.pool[:, :, a.pages[2], :2], eng.kv.pool[:, :, b.pages[2], :2]
    assert torch.equal(k_a.view(torch.int16), k_b.view(torch.int16))
    eng.truncate(b, 6)
    assert b.length == 6 and len(b.pages) == 2
    got = eng.pred(b, [9, 8, 7])
    full = base[:6] + [9, 8, 7]
    close_half(got, ref32.forward(full)[-1], refd.forward(full)[-1], dtype)
    eng.release(a)
    eng.release(b)
    assert eng.kv.allocator.num_used == 0


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_head_in_the_model_dtype(dtype):
    """float32_head=False (the GPU default): lm_head stays in the model dtype, no
    float32 copy; logits differ from the float32 head only by the head's rounding."""
    cfg = tiny_config()
    w = random_weights(cfg, seed=0)
    narrow = Engine(w, None, EngineConfig(page_size=4, num_pages=64, dtype=dtype, float32_head=False))
    wide = Engine(w, None, EngineConfig(page_size=4, num_pages=64, dtype=dtype))   # CPU default: float32
    assert narrow.model.lm_head.dtype == dtype and wide.model.lm_head.dtype == torch.float32
    assert EngineConfig().use_float32_head and not EngineConfig(float32_head=False).use_float32_head
    toks = rand_tokens(24)
    a = narrow.pred(narrow.new_sequence(), toks, all_logits=True)
    b = wide.pred(wide.new_sequence(), toks, all_logits=True)
    assert a.dtype == torch.float32
    ref32 = ReferenceLlama(w).forward(toks)
    torch.testing.assert_close(a, ref32, atol=2 * HALF_TINY_ATOL[dtype], rtol=0)
    diff = (a - b).abs().max().item()
    assert 0 < diff <= HALF_TINY_ATOL[dtype]          # the head's rounding, and nothing else
