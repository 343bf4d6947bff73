"""The seam: the engine's runner (run(ModelStep) -> StepOutput, a result or an
error per call) and KVFS around it (page tables handed in, one validation at
submission, the rollback of a failed chunked prefill), on tiny random models
against the plain PyTorch reference."""
import numpy as np
import pytest
import torch

from conftest import TINY_ATOL, tiny_config
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine
from symphony.engine.reference import ReferenceLlama
from symphony.engine.runner import ModelStep, StepCall, Want
from symphony.engine.sampler import check_sampling
from symphony.engine.weights import random_weights
from symphony.kvfs import KVFS, KVFSConfig, KVPred, NoSpace, Principal
from symphony.sched import BatchScheduler, Call

ALICE, BOB = Principal("alice", 1), Principal("bob", 2)


def toks(n, seed=0):
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def weights():
    return random_weights(tiny_config(), seed=0)


def close(a, b):
    torch.testing.assert_close(a, b, atol=TINY_ATOL, rtol=0)


# ------------------------------------------------------------------ the runner alone

def test_runner_writes_the_pages_it_is_given_and_allocates_nothing(weights):
    eng = Engine(weights, None, EngineConfig(page_size=4, num_pages=32))
    ref = ReferenceLlama(weights)
    alloc = eng.kv.allocator
    a, b = toks(9, 1), toks(6, 2)
    pa, pb = alloc.allocate(3), alloc.allocate(2)          # the caller's pages, the caller's books
    used = alloc.num_used
    out = eng.runner.run(ModelStep([StepCall(pa, 0, a[:7], list(range(7)), all_rows=True),
                                    StepCall(pb, 0, b, list(range(6)))]))
    assert alloc.num_used == used
    close(out.results[0].value, ref.forward(a[:7]))                      # [7, vocab]
    close(out.results[1].value, ref.forward(b)[-1:])                     # [1, vocab]
    # continue file a from slot 7 in the same pages: the K/V written above is read back
    out = eng.runner.run(ModelStep([StepCall(pa, 7, a[7:], [7, 8], all_rows=True)]))
    close(out.results[0].value, ref.forward(a)[7:])
    assert alloc.num_used == used


def test_runner_outputs_masks_topk_argmax_and_sampling(weights):
    eng = Engine(weights, None, EngineConfig(page_size=4, num_pages=32))
    ref = ReferenceLlama(weights)
    t = toks(5, 3)
    want = ref.forward(t)[-1]                                            # [vocab]
    allowed = np.zeros(101, dtype=bool)
    allowed[[3, 50, 97]] = True
    masked = want.masked_fill(~torch.from_numpy(allowed), float("-inf"))
    wants = [Want("argmax"), Want("argmax", mask=allowed), Want("topk", k=5, mask=allowed),
             Want("sample", mask=allowed, sampling=check_sampling(1.0, seed=7)),
             Want("sample", mask=allowed, sampling=check_sampling(1.0, seed=7)),
             Want("logits", mask=allowed)]
    calls = [StepCall(eng.kv.allocator.allocate(2), 0, t, list(range(5)), want=w) for w in wants]
    res = [r.value for r in eng.runner.run(ModelStep(calls)).results]
    assert res[0].tolist() == [int(want.argmax())]
    assert res[1].tolist() == [int(masked.argmax())]
    lp, ids = res[2]                                                     # [1, 5], [1, 5]
    assert ids.dtype == torch.int32 and set(ids[0, :3].tolist()) == {3, 50, 97}
    close(lp[0, :3], torch.log_softmax(masked, -1)[ids[0, :3].long()])
    assert res[3].tolist() == res[4].tolist() and res[3].item() in (3, 50, 97)   # seeded, in the mask
    close(res[5][0], masked)


def test_a_model_fault_fails_only_its_call(weights, monkeypatch):
    eng = Engine(weights, None, EngineConfig(page_size=4, num_pages=32))
    ref = ReferenceLlama(weights)
    real = eng.model.forward

    def forward(meta, kv):                                 # a fault for any batch holding token 100
        if (meta.tokens == 100).any():
            raise RuntimeError("device fault")
        return real(meta, kv)
    monkeypatch.setattr(eng.model, "forward", forward)
    good, bad = toks(6, 4), [1, 100, 2]
    out = eng.runner.run(ModelStep([StepCall(eng.kv.allocator.allocate(2), 0, good, list(range(6))),
                                    StepCall(eng.kv.allocator.allocate(1), 0, bad, [0, 1, 2])]))
    close(out.results[0].value[0], ref.forward(good)[-1])
    assert out.results[0].error is None
    assert isinstance(out.results[1].error, RuntimeError) and out.results[1].value is None


# ------------------------------------------------------------------ KVFS + scheduler around it

def drive(fs, sched, calls):
    """What the kernel's pred calls do (kernel/syscall/calls/pred.py): submit (check once), schedule, run."""
    pend = {}
    for who, h, t in calls:
        checked, _ = fs.check_pred(who, h, t)
        c = Call(key=(who.pid, h), lip=who.pid, user=who.user, n_tokens=len(checked), payload=(who, h, checked))
        sched.add(c)
        pend[id(c)] = c
    return pend


def run_step(fs, sched):
    step = sched.schedule()
    calls = [KVPred(c.payload[0], c.payload[1], c.payload[2][s:s + n], fed=s) for c, s, n in step.items]
    plan = fs.prepare(calls)                               # the kernel's step: prepare, run, commit
    results = fs.commit(plan, fs.engine.runner.run(plan.step))
    for (c, _, _), r in zip(step.items, results):
        if r.error is not None:                            # as the kernel does: drop its other chunks
            sched.drop(c)
    return step, results


def file_state(fs, h):
    inode = fs.handles[h].inode
    return (inode.length, list(inode.positions), [b.id for b in inode.blocks], [b.ref for b in inode.blocks],
            [b.device for b in inode.blocks])


@pytest.mark.parametrize("fault", ["out of pages", "model error"])
def test_failed_chunked_prefill_leaves_the_file_as_before(weights, monkeypatch, fault):
    """A long prompt fed in chunks whose third chunk fails (no device page left
    and nothing evictable; or the model failing for that call): the file is
    exactly as before the call, its pages freed, and the call of the same step
    that did not fail gets logits equal to the reference."""
    # 1 null page + 1 (a) + 2 (b) + 4 free: chunks 1 and 2 of the prompt take 2 pages each
    eng = Engine(weights, None, EngineConfig(page_size=4, num_pages=8 if fault == "out of pages" else 64))
    fs = KVFS(eng, KVFSConfig(host_pages=0))
    ref = ReferenceLlama(weights)
    ha, hb = fs.create(ALICE, "/home/alice/a.kv"), fs.create(BOB, "/home/bob/b.kv")
    a0, b0 = toks(3, 5), toks(5, 6)
    fs.pred(ALICE, ha, a0)
    fs.pred(BOB, hb, b0)
    before = file_state(fs, ha)
    used, charged = eng.kv.allocator.num_used, dict(fs.quotas.by_user)
    prompt = toks(25, 7)                                   # 3 + 25 tokens: the whole pool, 7 pages
    if fault == "model error":
        prompt[20] = 100                                   # in chunk 3 (tokens 16..23)
        real = eng.model.forward

        def forward(meta, kv):
            if (meta.tokens == 100).any():
                raise RuntimeError("device fault")
            return real(meta, kv)
        monkeypatch.setattr(eng.model, "forward", forward)
    sched = BatchScheduler(token_budget=64, chunk_tokens=8)
    drive(fs, sched, [(ALICE, ha, prompt)])
    for _ in range(2):                                     # chunks 1 and 2 go in
        step, res = run_step(fs, sched)
        assert [r.error for r in res] == [None]
    assert fs.handles[ha].inode.length == 3 + 16
    drive(fs, sched, [(BOB, hb, [42])])                    # a decode joins the step of chunk 3
    step, res = run_step(fs, sched)
    assert sorted(n for _, _, n in step.items) == [1, 8]
    by_user = {c.user: r for (c, _, _), r in zip(step.items, res)}
    close(by_user["bob"].value[0], ref.forward(b0 + [42])[-1])
    err = by_user["alice"].error
    assert isinstance(err, NoSpace if fault == "out of pages" else RuntimeError), err
    assert len(sched) == 0                                 # its last chunk is gone too
    assert file_state(fs, ha) == before                    # length, positions, blocks, refs, pages
    assert eng.kv.allocator.num_used == used                # every page of chunks 1-3 given back
    assert dict(fs.quotas.by_user) == charged
    # the file still works: the next pred continues from its old end
    close(fs.pred(ALICE, ha, [9]), ref.forward(a0 + [9])[-1])


def test_the_step_does_not_validate_again(weights, monkeypatch):
    """Validation happens once, at submission (check_pred); running the step
    (and each of a long call's chunks) never calls it again."""
    eng = Engine(weights, None, EngineConfig(page_size=4, num_pages=64))
    fs = KVFS(eng, KVFSConfig())
    ref = ReferenceLlama(weights)
    h = fs.create(ALICE, None)
    sched = BatchScheduler(token_budget=64, chunk_tokens=4)
    prompt = toks(10, 8)
    drive(fs, sched, [(ALICE, h, prompt)])

    def no(*a, **k):
        raise AssertionError("validated twice")
    monkeypatch.setattr(eng, "check_call", no)
    monkeypatch.setattr(fs, "check_pred", no)
    outs = [run_step(fs, sched)[1][0] for _ in range(3)]
    assert all(r.error is None for r in outs) and len(sched) == 0
    close(outs[-1].value[0], ref.forward(prompt)[-1])


def test_the_runner_serves_the_outputs_the_abi_declares():
    """The engine may not import the ABI (the layering test): the two tables are tied here."""
    from symphony.engine.runner import OUTPUTS
    from symphony.ipc import abi
    assert OUTPUTS == abi.OUTPUTS


def test_a_pred_call_feeds_its_chunks_and_asks_for_its_result_with_the_last():
    """One record from submission to reply (kernel/syscall/calls/pred.py): its chunks as KVFS feeds them."""
    from symphony.kernel.syscall.calls import PredCall, Stage
    from symphony.kernel.syscall.proc import LipProc
    lip = LipProc(7, "alice", "x.py", [], ring=None, grants={}, limits={})
    want = Want("topk", 5)
    c = PredCall(key=(7, 3), lip=7, user="alice", n_tokens=5, proc=lip, kv=3, tokens=[1, 2, 3, 4, 5],
                 positions=[10, 11, 12, 13, 14], all_logits=True, want=want)
    first, last = c.chunk(0, 3), c.chunk(3, 2)
    assert c.stage is Stage.QUEUED and c.remaining == 5
    assert (first.who, first.handle, list(first.tokens), list(first.positions), first.fed) == \
        (Principal("alice", 7), 3, [1, 2, 3], [10, 11, 12], 0)
    assert first.want == Want() and not first.all_logits                 # nothing back from an early chunk
    assert (list(last.tokens), last.fed, last.want, last.all_logits) == ([4, 5], 3, want, True)
