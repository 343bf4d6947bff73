"""Decode steps on static padded buffers (the CUDA-graph path) against the eager
engine and the plain PyTorch reference.

On the CPU the graph path runs eagerly (nothing to capture), which still
exercises everything the GPU relies on: bucket padding, padding rows that must
not write the KV pool, page tables narrower than the static buffer, stale rows
left by earlier steps.  The capture itself is tested where CUDA is present.
"""
import pytest
import torch

from conftest import TINY_ATOL, tiny_config
from symphony.engine import ops
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine, PredRequest
from symphony.engine.graphs import DecodeGraphs, bucket_sizes, decode_step
from symphony.engine.reference import ReferenceLlama
from symphony.engine.weights import random_weights


def engines(cfg=None, pages=256, page_size=4, max_batch=32, device="cpu", dtype=None):
    cfg = cfg or tiny_config()
    w = random_weights(cfg, seed=3)
    base = dict(page_size=page_size, num_pages=pages, device=device, dtype=dtype)
    graphed = Engine(w, None, EngineConfig(cuda_graphs=True, graph_max_batch=max_batch, **base))
    eager = Engine(w, None, EngineConfig(cuda_graphs=False, **base))
    return graphed, eager, w


def toks(n, seed, vocab=101):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_bucket_sizes_cover_every_batch():
    for m in (1, 3, 8, 64, 100, 128, 300):
        b = bucket_sizes(m)
        assert b == sorted(set(b)) and b[0] == 1 and b[-1] == m
        assert all(y - x <= 32 for x, y in zip(b, b[1:]))
    assert bucket_sizes(64)[:9] == [1, 2, 4, 8, 16, 24, 32, 40, 48]


def test_decode_step_slots():
    slots, lens = decode_step([[7, 3], [5]], [5, 0], page_size=4)
    assert slots == [3 * 4 + 1, 5 * 4] and lens == [6, 1]


def test_capture_needs_cuda():
    eng = Engine(random_weights(tiny_config()), None, EngineConfig(num_pages=16, cuda_graphs=False))
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(eng.model, eng.kv, 4, 8, capture=True)


def test_default_is_eager_on_cpu():
    eng = Engine(random_weights(tiny_config()), None, EngineConfig(num_pages=16))
    assert eng.graphs is None


def _decode_rounds(graphed, eager, ref_weights, lengths, rounds, fork_from=None):
    """Prefill sequences of the given lengths in both engines, then decode
    ``rounds`` steps of all of them together; compare every step's logits."""
    ref = ReferenceLlama(ref_weights)
    hist = [toks(n, seed=i) for i, n in enumerate(lengths)]
    gs, es = [], []
    for h in hist:
        g, e = graphed.new_sequence(), eager.new_sequence()
        graphed.pred(g, h)
        eager.pred(e, h)
        gs.append(g)
        es.append(e)
    if fork_from is not None:          # in-process forks: copies in pages of their own
        for i in fork_from:
            gs.append(graphed.fork(gs[i]))
            es.append(eager.fork(es[i]))
            hist.append(list(hist[i]))
    steps0 = graphed.stats.graph_steps
    kept = []
    for r in range(rounds):
        nxt = [toks(1, seed=100 * r + i)[0] for i in range(len(gs))]
        got = graphed.pred_batch([PredRequest(s, [t]) for s, t in zip(gs, nxt)])
        want = eager.pred_batch([PredRequest(s, [t]) for s, t in zip(es, nxt)])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=TINY_ATOL, rtol=0)
        kept.append([g.clone() for g in got])
        for i, t in enumerate(nxt):
            hist[i].append(t)
        if r == 0:
            first = got
    assert graphed.stats.graph_steps - steps0 == rounds
    # logits handed out by an earlier step are not overwritten by later ones
    for g, k in zip(first, kept[0]):
        assert torch.equal(g, k)
    for i, h in enumerate(hist):       # and the final state matches the reference
        torch.testing.assert_close(graphed.pred(gs[i], [5]), ref.forward(h + [5])[-1],
                                   atol=TINY_ATOL, rtol=0)
    return gs


@pytest.mark.parametrize("lengths", [[1], [3, 4, 5], [2, 9, 17, 30, 1], list(range(1, 18))],
                         ids=["b1", "b3", "b5-pad8", "b17-pad24"])
def test_graph_path_matches_eager_and_reference(lengths):
    graphed, eager, w = engines()
    _decode_rounds(graphed, eager, w, lengths, rounds=6)   # crosses page boundaries (page_size 4)


def test_graph_path_with_forks():
    graphed, eager, w = engines()
    _decode_rounds(graphed, eager, w, [5, 6, 11], rounds=3, fork_from=[0, 2])


def test_graph_path_with_copy_on_write_forks_through_kvfs():
    """Forks share their partial last page (KVFS owns the sharing): the first
    decode step copies it before the graph path writes into it."""
    from symphony.kvfs import KVFS, KVFSConfig, KVPred, Principal
    graphed, eager, w = engines()
    ref, who = ReferenceLlama(w), Principal("alice", 1)
    fss = [KVFS(graphed, KVFSConfig()), KVFS(eager, KVFSConfig())]
    hist = [toks(n, seed=i) for i, n in enumerate((5, 6, 11))]
    files = [[fs.create(who, None) for _ in hist] for fs in fss]
    for fs, hs in zip(fss, files):
        for h, t in zip(hs, hist):
            fs.pred(who, h, t)
        hs.extend(fs.fork(who, hs[i]) for i in (0, 2))
    hist += [list(hist[0]), list(hist[2])]
    shared = fss[0].handles[files[0][3]].inode.blocks[-1]
    assert shared is fss[0].handles[files[0][0]].inode.blocks[-1] and shared.ref == 2
    steps0 = graphed.stats.graph_steps
    for r in range(3):
        nxt = [toks(1, seed=100 * r + i)[0] for i in range(len(hist))]
        got, want = [fs.pred_batch([KVPred(who, h, [t]) for h, t in zip(hs, nxt)])
                     for fs, hs in zip(fss, files)]
        for i, t in enumerate(nxt):
            hist[i].append(t)
            torch.testing.assert_close(got[i], want[i], atol=TINY_ATOL, rtol=0)
            torch.testing.assert_close(got[i], ref.forward(hist[i])[-1], atol=TINY_ATOL, rtol=0)
    assert graphed.stats.graph_steps - steps0 == 3
    a, f = (fss[0].handles[files[0][i]].inode.blocks for i in (0, 3))
    assert a[0] is f[0] and a[-1] is not f[-1] and a[0].ref == 2 and a[-1].ref == 1


def test_batch_sizes_change_between_steps_and_stale_rows_do_not_leak():
    graphed, eager, w = engines(max_batch=16)
    ref = ReferenceLlama(w)
    hist = [toks(n, seed=10 + i) for i, n in enumerate((12, 3, 7, 20, 1, 9, 15, 2))]
    seqs = []
    for h in hist:
        seqs.append(graphed.new_sequence())
        graphed.pred(seqs[-1], h)
    steps0 = graphed.stats.graph_steps      # the 1-token prompt was a decode step already
    for step, members in enumerate([range(8), [1, 3], range(8), [5], [0, 2, 4, 6, 7]]):
        reqs, ids = [], []
        for i in members:
            t = toks(1, seed=1000 + step * 10 + i)[0]
            hist[i].append(t)
            reqs.append(PredRequest(seqs[i], [t]))
            ids.append(i)
        out = graphed.pred_batch(reqs)
        for i, o in zip(ids, out):
            torch.testing.assert_close(o, ref.forward(hist[i])[-1], atol=TINY_ATOL, rtol=0)
    assert graphed.stats.graph_steps - steps0 == 5


def test_padding_rows_write_nothing():
    graphed, _, _ = engines()
    seqs = []
    for i, n in enumerate((3, 6, 9)):                 # a batch of 3 runs in bucket 4
        seqs.append(graphed.new_sequence())
        graphed.pred(seqs[-1], toks(n, seed=i))
    before = graphed.kv.pool.clone()
    graphed.pred_batch([PredRequest(s, [1]) for s in seqs])
    changed = (graphed.kv.pool != before).transpose(0, 2).flatten(1).any(1)   # [num_pages]
    S = graphed.page_size
    written = {s.pages[(s.length - 1) // S] for s in seqs}
    assert set(changed.nonzero().flatten().tolist()) == written
    assert not changed[0]                             # the null page stays untouched


def test_prefill_and_mixed_batches_take_the_eager_path():
    graphed, eager, w = engines()
    a, b = graphed.new_sequence(), graphed.new_sequence()
    graphed.pred(a, toks(5, 0))
    graphed.pred_batch([PredRequest(a, [1]), PredRequest(b, toks(4, 1))])   # mixed: eager
    graphed.pred(a, [2], all_logits=True)                                    # all_logits: eager
    assert graphed.stats.graph_steps == 0
    graphed.pred(a, [3])
    assert graphed.stats.graph_steps == 1


def test_batches_wider_than_the_largest_graph_run_eagerly():
    graphed, eager, w = engines(max_batch=4)
    seqs = [graphed.new_sequence() for _ in range(6)]
    for i, s in enumerate(seqs):
        graphed.pred(s, toks(3, i))
    graphed.pred_batch([PredRequest(s, [1]) for s in seqs])
    assert graphed.stats.graph_steps == 0
    graphed.pred_batch([PredRequest(s, [1]) for s in seqs[:4]])
    assert graphed.stats.graph_steps == 1


@pytest.mark.parametrize("positions", [None, list(range(50, 63))], ids=["default", "offset"])
def test_fresh_prefill_fused_attention_matches_reference(positions):
    cfg = tiny_config(n_heads=6, n_kv_heads=2, head_dim=8, hidden_size=48)
    w = random_weights(cfg, seed=5)
    eng = Engine(w, None, EngineConfig(page_size=4, num_pages=64))
    assert not eng.model.fused_prefill                 # off on the CPU: the paged kernel is faster there
    eng.model.fused_prefill = True                     # the GPU's path, checked here
    fused, calls = eng.model._causal_attention, []
    eng.model._causal_attention = lambda *a: calls.append(1) or fused(*a)
    ref = ReferenceLlama(w)
    t = toks(13, 7)
    got = eng.pred(eng.new_sequence(), t, positions, all_logits=True)
    assert len(calls) == cfg.n_layers                  # every layer took the fused path
    torch.testing.assert_close(got, ref.forward(t, positions), atol=TINY_ATOL, rtol=0)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)])
def test_cuda_graph_replay_matches_eager(dtype, atol):
    if not ops.cuda_available():
        pytest.skip("the CUDA kernels were not built")
    graphed, eager, _ = engines(device="cuda", dtype=dtype, max_batch=24)
    assert graphed.graphs._graphs, "no graph was captured"
    lengths = [4, 9, 1, 17, 30]
    gs, es = [], []
    for i, n in enumerate(lengths):
        gs.append(graphed.new_sequence())
        es.append(eager.new_sequence())
        graphed.pred(gs[-1], toks(n, i))
        eager.pred(es[-1], toks(n, i))
    # the 1-token prompt was a decode step already (on an H100, the old absolute count read 6)
    steps0, replays0 = graphed.stats.graph_steps, graphed.graphs.replays
    assert steps0 == replays0 == 1
    for r in range(5):
        nxt = [toks(1, 50 + 10 * r + i)[0] for i in range(len(gs))]
        got = graphed.pred_batch([PredRequest(s, [t]) for s, t in zip(gs, nxt)])
        want = eager.pred_batch([PredRequest(s, [t]) for s, t in zip(es, nxt)])
        for g, w_ in zip(got, want):
            torch.testing.assert_close(g, w_, atol=atol, rtol=0)
    assert graphed.stats.graph_steps - steps0 == 5 and graphed.graphs.replays - replays0 == 5


def test_head_float32_output_is_cuda_only():
    from symphony.engine.model import _mm_float32_out
    assert not _mm_float32_out(torch.device("cpu"), torch.bfloat16)
    eng = Engine(random_weights(tiny_config()), None, EngineConfig(num_pages=16, dtype=torch.bfloat16))
    assert not eng.model.head_f32_out


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_16bit_head_returns_unrounded_float32_logits(dtype):
    """A 16-bit lm_head on CUDA writes float32 logits (not the dtype's rounded steps, which tie
    close candidates), graphs on and off, within the dtype's noise of the float32 model."""
    if not ops.cuda_available():
        pytest.skip("the CUDA kernels were not built")
    graphed, eager, w = engines(device="cuda", dtype=dtype, max_batch=8)
    assert graphed.model.head_f32_out and eager.model.head_f32_out
    ref = Engine(w, None, EngineConfig(page_size=4, num_pages=64, device="cuda", dtype=torch.float32,
                                       cuda_graphs=False))
    for eng in (graphed, eager, ref):
        s = eng.new_sequence()
        eng.pred(s, toks(9, 1))
        eng._last = eng.pred(s, toks(1, 2))          # a decode step (a graph replay on `graphed`)
    for eng in (graphed, eager):
        lg = torch.as_tensor(eng._last).float()
        assert lg.dtype == torch.float32
        assert not torch.equal(lg, lg.to(dtype).float()), "logits were rounded to the 16-bit dtype"
        torch.testing.assert_close(lg, torch.as_tensor(ref._last).float(), atol=5e-2, rtol=0)
