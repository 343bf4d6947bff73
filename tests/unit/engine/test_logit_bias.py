"""A pred's logit_bias in the runner (the kernel's step runs it): every output against
the plain PyTorch reference's logits plus the bias, on a tiny random model; the bias
comes before the mask, leaves the shared logits untouched, and keeps a biased argmax
out of the batch's one-kernel argmax."""
import numpy as np
import torch

from conftest import TINY_ATOL, tiny_config
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine
from symphony.engine.reference import ReferenceLlama
from symphony.engine.runner import ModelStep, StepCall, Want, finish
from symphony.engine.sampler import apply_bias, check_sampling
from symphony.engine.weights import random_weights


def _bias(pairs):
    return (np.array([t for t, _ in pairs], dtype=np.int64), np.array([v for _, v in pairs], dtype=np.float32))


def test_every_output_sees_the_biased_logits():
    weights = random_weights(tiny_config(), seed=0)
    eng, ref = Engine(weights, None, EngineConfig(page_size=4, num_pages=32)), ReferenceLlama(weights)
    t = torch.randint(0, 101, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = ref.forward(t)[-1]                                           # [vocab]
    top = int(plain.argmax())
    pairs = [(top, -100.0), (int(plain.argsort(descending=True)[1]), 0.5), (42, 7.25)]
    biased = plain.clone()
    for i, v in pairs:
        biased[i] += v
    allowed = np.zeros(101, dtype=bool)
    allowed[[top, 42, 60]] = True
    masked = biased.masked_fill(~torch.from_numpy(allowed), float("-inf"))
    b = _bias(pairs)
    wants = [Want("logits", bias=b), Want("argmax", bias=b), Want("argmax"), Want("topk", k=4, bias=b),
             Want("argmax", mask=allowed, bias=b), Want("sample", sampling=check_sampling(1.0, seed=1),
                                                         bias=_bias([(9, 100.0)])),
             Want("argmax", bias=_bias([(int(plain.argmin()), 100.0)]))]
    calls = [StepCall(eng.kv.allocator.allocate(2), 0, t, list(range(6)), want=w) for w in wants]
    res = [r.value for r in eng.runner.run(ModelStep(calls)).results]
    torch.testing.assert_close(res[0][0], biased, atol=TINY_ATOL, rtol=0)
    assert res[1].tolist() == [int(biased.argmax())] and res[2].tolist() == [top] != res[1].tolist()
    lp, ids = res[3]
    assert ids[0].tolist() == biased.argsort(descending=True)[:4].tolist()
    torch.testing.assert_close(lp[0], torch.log_softmax(biased, -1)[ids[0].long()], atol=TINY_ATOL, rtol=0)
    assert res[4].tolist() == [int(masked.argmax())]
    assert res[5].tolist() == [9]
    assert res[6].tolist() == [int(plain.argmin())]                      # not the batch's shared argmax


def test_the_bias_writes_a_copy_and_keeps_other_rows_apart():
    x = torch.arange(12, dtype=torch.float32).reshape(2, 6)                 # [rows, vocab]
    before = x.clone()
    y = apply_bias(x, _bias([(0, 10.0), (5, -3.0)]))
    assert torch.equal(x, before)
    assert y[:, 0].tolist() == [10.0, 16.0] and y[:, 5].tolist() == [2.0, 8.0]
    assert torch.equal(y[:, 1:5], x[:, 1:5])
    assert torch.equal(finish(x.half(), Want("logits")), x.half())          # no bias: as before, no copy
