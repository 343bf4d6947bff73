"""The simulated device (engine/sim.py): its profiles, its modelled time (with the GIL released),
and logits that are a fixed function of each row's token, position and the token before it in
its file -- read back from the KV pool, so batching cannot change a row and a wrong page would."""
import threading
import time

import numpy as np
import pytest
import torch

from symphony.engine.config import ConfigError, EngineConfig
from symphony.engine.engine import PredRequest
from symphony.engine.runner import ModelStep, StepCall, Want
from symphony.engine.sampler import check_sampling
from symphony.engine.sim import PROFILES, SimEngine, SimProfile, parse_profile

from conftest import tiny_config

FREE = SimProfile("free", 0.0, 0.0, 0.0, 0.0)
ARGMAX = Want("argmax")


def engine(profile=FREE, pages=64, **over) -> SimEngine:
    return SimEngine(tiny_config(**over), None, EngineConfig(num_pages=pages, dtype=torch.bfloat16), profile)


def greedy(e, seq, tokens) -> int:
    return int(e.pred_batch([PredRequest(seq, tokens, want=ARGMAX)])[0])


# ------------------------------------------------------------------ profiles
def test_profiles_parse_by_name_or_setting():
    assert parse_profile("sim") is PROFILES["h200-1b"]
    assert parse_profile("sim:h200-smollm2") is PROFILES["h200-smollm2"]
    p = parse_profile("sim:step_ms=2,call_us=10")
    assert (p.step_s, p.call_s) == pytest.approx((2e-3, 10e-6))
    assert (p.token_s, p.kv_s) == (PROFILES["h200-1b"].token_s, PROFILES["h200-1b"].kv_s)   # the rest: default
    for bad, says in (("cpu", "'sim' or 'sim:PROFILE'"), ("sim:h100", "no such profile"),
                      ("sim:step_ms=x", "must be a number"), ("sim:step_ms=-1", ">= 0"),
                      ("sim:warp=9", "unknown setting"), ("simulated", "'sim' or 'sim:PROFILE'")):
        with pytest.raises(ConfigError, match=says):
            parse_profile(bad)


def test_the_1b_profile_is_the_h200_figures():
    """Batch 1 ~1.5 ms, 16 ~1.7 ms, 64 ~2.1 ms a decode step at a short context (perf/RESULTS.md)."""
    p = PROFILES["h200-1b"]
    step = [StepCall([1, 2, 3, 4], 40, [5], [40])]
    assert p.step_time(step) == pytest.approx(1.52e-3, abs=0.03e-3)
    assert p.step_time(step * 16) == pytest.approx(1.66e-3, abs=0.06e-3)
    assert p.step_time(step * 64) == pytest.approx(2.1e-3, abs=0.06e-3)
    prompt = [StepCall(list(range(1, 130)), 0, list(range(2000)), list(range(2000)))]
    assert 9e-3 < p.step_time(prompt) < 14e-3              # a 2,000-token prompt: ~11 ms


# ------------------------------------------------------------------ logits
def test_greedy_is_reproducible_and_batching_changes_no_row():
    e = engine()
    prompts = [[3, 4, 5], [7, 8], [9, 10, 11, 12]]
    alone = []
    for p in prompts:
        s = e.new_sequence()
        toks = [greedy(e, s, p)]
        for _ in range(20):
            toks.append(greedy(e, s, [toks[-1]]))
        alone.append(toks)
        e.release(s)
    seqs = [e.new_sequence() for _ in prompts]
    outs = e.pred_batch([PredRequest(s, p, want=ARGMAX) for s, p in zip(seqs, prompts)])
    together = [[int(o)] for o in outs]
    for _ in range(20):
        outs = e.pred_batch([PredRequest(s, [t[-1]], want=ARGMAX) for s, t in zip(seqs, together)])
        for t, o in zip(together, outs):
            t.append(int(o))
    assert together == alone
    assert len({tuple(t) for t in alone}) == 3                  # different prompts, different text


def test_a_row_depends_on_the_token_before_it_in_the_file():
    e = engine()
    a, b = e.new_sequence(), e.new_sequence()
    greedy(e, a, [3, 4, 5])
    greedy(e, b, [3, 4, 6])
    # the same token at the same position, after a different token: another row
    assert greedy(e, a, [9]) != greedy(e, b, [9])
    # the token before is read from the pool: a copy of the pages (fork) continues alike
    c = e.fork(a)
    e.truncate(a, 3)
    e.truncate(c, 3)
    assert greedy(e, a, [9]) == greedy(e, c, [9])


def test_logits_sampling_and_masks_go_through_the_engine_sampler():
    e = engine()
    s = e.new_sequence()
    logits = e.pred(s, [3, 4, 5])                            # [vocab] float32
    assert logits.dtype == torch.float32 and logits.shape == (101,)
    e.truncate(s, 0)
    best = greedy(e, s, [3, 4, 5])
    assert int(logits.argmax()) == best                       # argmax without logits: the same token
    e.truncate(s, 0)
    lp, ids = e.pred_batch([PredRequest(s, [3, 4, 5], want=Want("topk", 5))])[0]
    assert int(ids[0]) == best and bool((lp[:-1] >= lp[1:]).all())
    e.truncate(s, 0)
    drawn = e.pred_batch([PredRequest(s, [3, 4, 5], want=Want("sample", sampling=check_sampling(1e-4)))])[0]
    assert int(drawn) == best                                 # a cold sample is the greedy token
    e.truncate(s, 0)
    mask = np.ones(101, dtype=bool)
    mask[best] = False
    other = int(e.pred_batch([PredRequest(s, [3, 4, 5], want=Want("argmax", mask=mask))])[0])
    assert other != best and mask[other]


def test_greedy_tokens_are_ordinary_tokens():
    """No special or end-of-sequence token: a simulated run ends by its length, not by chance."""
    e = engine()
    s = e.new_sequence()
    toks = [greedy(e, s, [1, 2])]
    for _ in range(200):
        toks.append(greedy(e, s, [toks[-1]]))
    assert set(toks) <= set(e.runner.targets.tolist())


# ------------------------------------------------------------------ time
def test_a_step_takes_its_modelled_time_with_the_gil_released():
    e = engine(SimProfile("slow", 0.05, 0.0, 0.0, 0.0))
    s = e.new_sequence()
    spins = [0]
    stop = threading.Event()

    def spinner():                                            # Python work: needs the GIL
        while not stop.is_set():
            spins[0] += 1
    t = threading.Thread(target=spinner)
    t.start()
    try:
        t0 = time.perf_counter()
        greedy(e, s, [3])
        dt = time.perf_counter() - t0
        before = spins[0]
        time.sleep(0.05)                                      # what the spinner does in 50 ms, free
        free = spins[0] - before
        n0 = spins[0]
        greedy(e, s, [4])
        during = spins[0] - n0
    finally:
        stop.set()
        t.join()
    assert 0.05 <= dt < 0.5
    assert during > free / 10, (during, free)                 # the step left the GIL to the spinner


def test_the_runner_contract_holds():
    e = engine(pages=8)
    step = ModelStep([StepCall([1], 0, list(range(1, 9)), list(range(8)))] * 2)
    e.runner.max_batch_tokens = 10                            # 16 tokens: over the budget, each call refused
    out = e.runner.run(step)
    assert all("max_batch_tokens" in str(r.error) for r in out.results)
    assert e.runner.run(ModelStep([])).results == []


def test_a_simulated_engine_reads_no_weights(tmp_path):
    from modelfiles import write_tiny_gguf
    path = write_tiny_gguf(tmp_path, seed=1)
    e = SimEngine.load(path, EngineConfig(num_pages=32, dtype=torch.bfloat16), FREE)
    assert e.model is None and e.model_id == path.stem and e.tokenizer is not None
    assert e.calibrate_kernels() is None
    s = e.new_sequence()
    assert 0 <= greedy(e, s, e.tokenizer.encode("hello")) < e.model_config.vocab_size
    with pytest.raises(ConfigError, match="device must be 'cpu'"):
        SimEngine(tiny_config(), None, EngineConfig(device="meta"), FREE)
