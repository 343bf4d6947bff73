"""Scheduler unit tests on a fake clock and a fake model (no torch, no kernel)."""
import random

import pytest

from symphony.sched import BatchScheduler, Call, LipView, admit, priority_of, swap_out_order


def comp(step):
    return [(c.key, s, n) for c, s, n in step.items]


def test_exact_batch_composition_decodes_first_then_a_prefill_chunk():
    s = BatchScheduler(token_budget=64, chunk_tokens=32)
    s.add(Call("c", lip=3, user="u", n_tokens=100, arrival=0.0))
    s.add(Call("a", lip=1, user="u", n_tokens=1, arrival=1.0))
    s.add(Call("b", lip=2, user="v", n_tokens=1, arrival=2.0))
    assert comp(s.schedule()) == [("a", 0, 1), ("b", 0, 1), ("c", 0, 32)]
    assert comp(s.schedule()) == [("c", 32, 32)]
    assert comp(s.schedule()) == [("c", 64, 32)]
    step = s.schedule()
    assert comp(step) == [("c", 96, 4)] and [c.key for c in step.final()] == ["c"]
    assert s.schedule() is None


def test_token_budget_is_respected_under_random_load():
    rng = random.Random(0)
    s = BatchScheduler(token_budget=100, chunk_tokens=40)
    fed = {}
    for i in range(300):
        n = rng.choice([1, 1, 1, 5, 60, 250])
        s.add(Call(i, lip=i % 7, user=f"u{i % 3}", n_tokens=n, arrival=i))
        fed[i] = n
    got = {}
    while (step := s.schedule()) is not None:
        assert step.tokens <= 100
        assert len({c.key for c, _, _ in step.items}) == len(step.items)
        for c, start, n in step.items:
            assert start == got.get(c.key, 0)              # chunks in order, no gap, no overlap
            got[c.key] = start + n
    assert got == fed                                       # every token fed exactly once


def test_long_prompt_is_chunked():
    s = BatchScheduler(token_budget=256, chunk_tokens=256)
    s.add(Call("p", lip=1, user="u", n_tokens=1000))
    steps = [comp(s.schedule()) for _ in range(4)]
    assert steps == [[("p", 0, 256)], [("p", 256, 256)], [("p", 512, 256)], [("p", 768, 232)]]


def test_no_starvation_long_prefill_and_32_decoders():
    """Each decoder re-issues a one-token call after every reply (a LIP loop):
    every decoder progresses every step while the prefill also advances."""
    s = BatchScheduler(token_budget=128, chunk_tokens=64)
    s.add(Call("prefill", lip=99, user="big", n_tokens=4000))
    for d in range(32):
        s.add(Call(f"d{d}", lip=d, user=f"user{d % 4}", n_tokens=1))
    progress = {f"d{d}": 0 for d in range(32)}
    prefill_fed = 0
    for step_no in range(50):
        step = s.schedule()
        keys = [c.key for c, _, _ in step.items]
        for d in range(32):
            assert f"d{d}" in keys, f"decoder {d} skipped at step {step_no}"
        for c in step.final():
            if c.key.startswith("d"):
                progress[c.key] += 1
                s.add(Call(c.key, lip=c.lip, user=c.user, n_tokens=1))     # its next token
        prefill_fed += sum(n for c, _, n in step.items if c.key == "prefill")
    assert all(v == 50 for v in progress.values())
    assert prefill_fed == 50 * 64                  # one chunk (<= chunk_tokens, <= the leftover 96) a step


def test_sibling_calls_share_a_step_but_one_file_runs_in_order():
    s = BatchScheduler(token_budget=64)
    for t in range(4):                                      # 4 threads of LIP 1, 4 files
        s.add(Call(("lip1", t), lip=1, user="u", n_tokens=1))
    s.add(Call(("lip1", 0), lip=1, user="u", n_tokens=1))  # a second call on file 0
    assert sorted(c.key for c, _, _ in s.schedule().items) == [("lip1", t) for t in range(4)]
    assert [c.key for c, _, _ in s.schedule().items] == [("lip1", 0)]


def test_priority_order_when_the_budget_is_short():
    s = BatchScheduler(token_budget=2)
    s.add(Call("low", lip=1, user="u", n_tokens=1, priority=-1, arrival=0))
    s.add(Call("normal", lip=2, user="v", n_tokens=1, priority=0, arrival=1))
    s.add(Call("high", lip=3, user="w", n_tokens=1, priority=1, arrival=2))
    assert [c.key for c, _, _ in s.schedule().items] == ["high", "normal"]
    assert [c.key for c, _, _ in s.schedule().items] == ["low"]


def test_fairness_between_users_jain_index():
    """User X runs 10 decoding LIPs, user Y one; with room for 4 tokens a step,
    tokens are shared between the users, not between the LIPs."""
    s = BatchScheduler(token_budget=4)
    lips = [(f"x{i}", i, "X") for i in range(10)] + [("y0", 100, "Y")]
    for key, lip, user in lips:
        s.add(Call(key, lip=lip, user=user, n_tokens=1))
    for _ in range(200):
        for c in s.schedule().final():
            s.add(Call(c.key, lip=c.lip, user=c.user, n_tokens=1))
    x, y = s.served_user["X"], s.served_user["Y"]
    # Y's single LIP can take at most one token a step: it must get one every step
    assert y == 200 and x == 600
    per_x = [s.served_lip[i] for i in range(10)]
    assert max(per_x) - min(per_x) <= 1                          # X's LIPs share X's part evenly
    jain = sum(per_x) ** 2 / (len(per_x) * sum(v * v for v in per_x))
    assert jain >= 0.99


def test_gather_window_on_a_fake_clock():
    s = BatchScheduler(token_budget=64, gather_s=0.003)
    for t in range(4):
        s.add(Call(t, lip=1, user="u", n_tokens=1))
    s.schedule()                                              # a step of 4
    s.add(Call(0, lip=1, user="u", n_tokens=1))               # one caller is back
    assert s.should_wait(now=10.000) is True                  # wait for the other three...
    assert s.should_wait(now=10.002) is True
    assert s.should_wait(now=10.004) is False                 # ...but not past the window
    for t in (1, 2, 3):
        s.add(Call(t, lip=1, user="u", n_tokens=1))
    assert s.should_wait(now=10.005) is False                 # all back: launch


def test_gather_waits_for_the_callers_not_a_count():
    """Stragglers of one step must not set the size of the next: with 8 of 64
    callers always late (queued while the step ran), a count-based window
    would launch each step with 56 calls forever."""
    s = BatchScheduler(token_budget=128, gather_s=0.003)
    keys = list(range(64))
    for k in keys[:56]:
        s.add(Call(k, lip=k, user="u", n_tokens=1))
    assert len(s.schedule().items) == 56                      # 8 missed this step
    for k in keys[56:]:
        s.add(Call(k, lip=k, user="u", n_tokens=1))           # the late 8 arrive
    for k in keys[:48]:
        s.add(Call(k, lip=k, user="u", n_tokens=1))           # 48 of the 56 are back: 56 queued
    assert s.should_wait(now=1.0) is True                     # 8 callers of the last step missing
    for k in keys[48:56]:
        s.add(Call(k, lip=k, user="u", n_tokens=1))
    assert s.should_wait(now=1.001) is False
    assert len(s.schedule().items) == 64


def test_a_caller_that_exits_does_not_hold_the_step():
    s = BatchScheduler(token_budget=64, gather_s=0.003)
    s.add(Call((1, 5), lip=1, user="u", n_tokens=1))
    s.add(Call((2, 5), lip=2, user="u", n_tokens=1))
    s.schedule()
    s.add(Call((2, 5), lip=2, user="u", n_tokens=1))
    assert s.should_wait(now=1.0) is True
    s.drop_lip(1)                                             # LIP 1 exited
    assert s.should_wait(now=1.0) is False


def test_drop_lip_forgets_its_calls():
    s = BatchScheduler()
    s.add(Call("a", lip=1, user="u", n_tokens=5))
    s.add(Call("b", lip=2, user="u", n_tokens=5))
    assert [c.key for c in s.drop_lip(1)] == ["a"]
    assert [c.key for c, _, _ in s.schedule().items] == ["b"]


def test_swap_out_order_blocked_lips_first():
    lips = [LipView(1, priority=0, blocked=False, last_active=5.0, device_pages=10),
            LipView(2, priority=0, blocked=True, blocked_since=3.0, device_pages=4),
            LipView(3, priority=1, blocked=True, blocked_since=1.0, device_pages=4),
            LipView(4, priority=-1, blocked=False, last_active=9.0, device_pages=2),
            LipView(5, priority=0, blocked=True, blocked_since=2.0, device_pages=0)]   # nothing to free
    assert swap_out_order(lips) == [2, 3, 4, 1]


def test_admission_and_priority_classes():
    assert admit(running=3, max_lips=4, pages_free=100, pages_reserve=10) == (True, "")
    ok, why = admit(running=4, max_lips=4, pages_free=100, pages_reserve=10)
    assert not ok and "too many LIPs" in why
    ok, why = admit(running=1, max_lips=4, pages_free=5, pages_reserve=10)
    assert not ok and "KV memory is short" in why
    assert priority_of("interactive") == 1 and priority_of("batch") == -1 and priority_of(3) == 3
    with pytest.raises(ValueError):
        priority_of("urgent")


def test_held_lips_stay_queued_and_are_not_scheduled():
    s = BatchScheduler(token_budget=64, chunk_tokens=32)
    s.add(Call("a", lip=1, user="u", n_tokens=1))
    s.add(Call("b", lip=2, user="u", n_tokens=40))
    s.held = {2}
    assert comp(s.schedule()) == [("a", 0, 1)]
    assert s.schedule() is None and len(s) == 1 and s.runnable() == 0      # b waits, not dropped
    s.held = set()
    assert comp(s.schedule()) == [("b", 0, 32)]


def test_gathering_does_not_wait_for_a_held_lip():
    s = BatchScheduler(token_budget=64, chunk_tokens=32, gather_s=10.0)
    s.add(Call("a", lip=1, user="u", n_tokens=1))
    s.add(Call("b", lip=2, user="u", n_tokens=1))
    s.schedule()
    s.add(Call("a", lip=1, user="u", n_tokens=1))
    assert s.should_wait(0.0)                          # b's LIP may come back
    s.held = {2}
    assert not s.should_wait(0.0)                      # held: it cannot come back this step


def test_next_chunks_names_each_files_first_call_and_its_chunk():
    s = BatchScheduler(token_budget=64, chunk_tokens=32)
    s.add(Call("a", lip=1, user="u", n_tokens=100))
    s.add(Call("a", lip=1, user="u", n_tokens=5))      # same file: waits for the first
    s.add(Call("b", lip=1, user="u", n_tokens=1))
    s.add(Call("c", lip=2, user="u", n_tokens=10))
    got = {lip: [(c.key, n) for c, n in v] for lip, v in s.next_chunks().items()}
    assert got == {1: [("a", 32), ("b", 1)], 2: [("c", 10)]}
    s.drop_lip(2)
    assert 2 not in s.next_chunks()


def test_the_queue_verbs_hold_drop_and_fail_a_lip():
    """The queue's one writer is the scheduler: hold (memory), drop (a failed call), fail_lip."""
    s = BatchScheduler(token_budget=64, chunk_tokens=8)
    a, b, c = (Call(k, lip=lip, user="u", n_tokens=n, arrival=float(i))
               for i, (k, lip, n) in enumerate((("a", 1, 20), ("b", 2, 1), ("c", 2, 1))))
    for call in (a, b, c):
        s.add(call)
    s.hold({2})
    assert comp(s.schedule()) == [("a", 0, 8)] and s.queued_lips() == {1, 2}
    s.drop(a)                                          # its other chunks never run
    s.hold(())
    assert comp(s.schedule()) == [("b", 0, 1), ("c", 0, 1)]
    s.add(d := Call("d", lip=2, user="u", n_tokens=3))
    assert s.fail_lip(2) == [d] and len(s) == 0 and s.schedule() is None
    s.took(1.0)
    assert s.gather_s == 0.050                         # a quarter of the pass, at most 50 ms
    s.took(0.004)
    assert s.gather_s == 0.001


def test_admission_counts_another_users_pages_beyond_its_share_as_free():
    """Alice's LIPs hold all 32 pages; bob's LIP, within his share (16), may count on what
    she holds beyond hers (the memory manager suspends her LIPs for his); hers may not."""
    from symphony.sched import Machine
    m = Machine(admitted=4, max_lips=64, per_user={"alice": 4}, max_per_user=None, device_free=0,
                holding=tuple((0, 8, 8, "alice") for _ in range(4)), capacity=32)
    assert m.free_for(0, "bob") == 16 and m.free_for(0, "alice") == 0
    assert m.free_for(1, "bob") == 32                             # a higher class: all of it, as before
    assert m.free_for(-1, "bob") == 0                             # a lower class: nothing of hers


def test_gathering_counts_again_when_a_queued_caller_is_taken_out():
    """The callers still missing are kept as calls arrive; a call taken out (failed, its LIP
    gone) or a hold that changes makes the scheduler count them again."""
    s = BatchScheduler(token_budget=64, chunk_tokens=32, gather_s=10.0)
    for key, lip in (("a", 1), ("b", 2), ("c", 3)):
        s.add(Call(key, lip=lip, user="u", n_tokens=1))
    s.schedule()
    s.add(Call("a", lip=1, user="u", n_tokens=1))
    assert s.should_wait(0.0)                              # b and c are coming back
    b = Call("b", lip=2, user="u", n_tokens=1)
    s.add(b)
    s.add(Call("c", lip=3, user="u", n_tokens=1))
    assert not s.should_wait(0.0)                          # all back: launch
    s.drop(b)                                              # b's call failed: b's LIP may call again
    assert s.should_wait(0.0)
    s.hold({2})                                            # ...unless it is held
    assert not s.should_wait(0.0)
    s.hold(set())
    assert s.should_wait(0.0)
    s.fail_lip(3)
    s.add(Call("b", lip=2, user="u", n_tokens=1))
    assert s.should_wait(0.0)                              # c's call was taken out: missing again
    s.drop_lip(3)
    assert not s.should_wait(0.0)                          # c's LIP is gone: nobody to wait for
