"""Greedy decode steps on the graph path: the argmax and the token copy belong to the graph
(`DecodeGraphs.run_tokens`), and the runner hands the calls their tokens on the host.

On the CPU the graph path runs eagerly (nothing to capture): these tests check which steps take
it, that the tokens are the eager engine's greedy tokens, and that the kernel's landing of a
step's results takes host tokens as it takes device ones. The capture itself, and a replay from
another thread, are tested on CUDA (test_cuda_kernels.py)."""
import numpy as np
import torch

from conftest import tiny_config
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine, PredRequest
from symphony.engine.runner import ModelStep, StepCall, Want, greedy
from symphony.engine.sampler import check_sampling
from symphony.engine.weights import random_weights
from symphony.kernel.syscall.device import land


def _engines():
    w = random_weights(tiny_config(), seed=7)
    base = dict(page_size=4, num_pages=256)
    return (Engine(w, None, EngineConfig(cuda_graphs=True, graph_max_batch=16, **base)),
            Engine(w, None, EngineConfig(cuda_graphs=False, **base)))


def _prefill(eng, n):
    seqs = [eng.new_sequence() for _ in range(n)]
    eng.pred_batch([PredRequest(s, [3 + i, 17, 40 + i, 8]) for i, s in enumerate(seqs)])
    return seqs


def test_greedy_wants():
    assert greedy(Want("argmax")) and greedy(Want("sample", sampling=check_sampling(0)))
    assert not greedy(Want("argmax", mask=np.ones(101, bool)))
    assert not greedy(Want("sample", sampling=check_sampling(0.7)))
    assert not greedy(Want("logits")) and not greedy(Want("topk"))


def test_a_greedy_decode_step_returns_host_tokens_equal_to_the_eager_argmax():
    graphed, eager = _engines()
    gs, es = _prefill(graphed, 5), _prefill(eager, 5)
    calls = graphed.runner.graphs.replays
    for step in range(3):
        nxt = [20 + step + i for i in range(5)]
        wants = [Want("argmax")] * 4 + [Want("sample", sampling=check_sampling(0))]
        got = graphed.pred_batch([PredRequest(s, [t], want=w) for s, t, w in zip(gs, nxt, wants)])
        logits = eager.pred_batch([PredRequest(s, [t]) for s, t in zip(es, nxt)])
        assert all(v.device.type == "cpu" and v.dtype == torch.int64 and v.shape == () for v in got)
        assert [int(v) for v in got] == [int(x.argmax()) for x in logits]
    assert graphed.runner.graphs.replays == calls + 3 and graphed.stats.graph_steps >= 3


def test_a_step_with_any_other_want_takes_the_logits_path():
    graphed, _ = _engines()
    seqs = _prefill(graphed, 3)
    mask = np.zeros(101, bool)
    mask[[5, 9]] = True
    got = graphed.pred_batch([PredRequest(seqs[0], [11], want=Want("argmax")),
                              PredRequest(seqs[1], [12], want=Want("argmax", mask=mask)),
                              PredRequest(seqs[2], [13])])
    assert int(got[1]) in (5, 9) and got[2].shape == (101,)
    assert got[0].shape == () and graphed.stats.graph_steps >= 1


def test_the_kernel_lands_host_tokens_like_device_ones():
    graphed, _ = _engines()
    seqs = _prefill(graphed, 2)
    runner = graphed.runner
    step = ModelStep([StepCall(pages=s.pages + ([runner.kv.allocator.allocate(1)[0]] if s.length % 4 == 0 else []),
                               start=s.length, tokens=[21 + i], positions=[s.length], want=Want("argmax"))
                      for i, s in enumerate(seqs)])
    out = runner.run(step)
    assert all(r.error is None and r.value.device.type == "cpu" for r in out.results)
    assert land(out, ["argmax", "argmax"], cuda=False) == [[int(r.value[0])] for r in out.results]
