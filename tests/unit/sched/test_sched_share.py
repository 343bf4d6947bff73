"""Each user's share of a forward pass (sched/share.py, sched/cost.py), exact, on a fake clock.

The fixed cost model is this CPU's shape (an Intel Xeon, SmolLM2-135M Q4_1, 2 threads): a step
costs 4 ms, each token 0.75 ms and each call 0.75 ms more (a decode of 16 sequences 28 ms, of one
5.5 ms; a 128-token prefill chunk 101 ms)."""
import pytest

from symphony.sched import BatchScheduler, Call
from symphony.sched.cost import StepCost, attention_pairs
from symphony.sched.share import Demand, capacity, split

CPU = dict(base=0.004, per_token=0.00075, per_call=0.00075)


def sched(**kw):
    kw.setdefault("cost", StepCost.fixed(**CPU))
    return BatchScheduler(**{"token_budget": 256, "chunk_tokens": 128, **kw})


def comp(step):
    return [(c.key, s, n) for c, s, n in step.items]


def again(s, step):
    """Each finished decode asks for its next token (a LIP's loop)."""
    for c in step.final():
        s.add(Call(c.key, lip=c.lip, user=c.user, n_tokens=1, priority=c.priority))


def predicted(s, step):
    return s.cost.seconds(step.tokens, len(step.items))


def test_one_user_alone_gets_the_whole_budget():
    s = sched()
    for i in range(16):
        s.add(Call(f"a{i}", lip=i, user="alice", n_tokens=1))
    assert len(s.schedule().items) == 16


def test_a_light_user_beside_16_streams_rides_every_step_of_a_narrow_batch():
    """The even step (a token each) takes 7 ms, so the shared one may take 10.5 ms: 4 calls,
    bob's and 3 of alice's (10 ms, 1.8x bob's 5.5 ms alone), hers in turns (each of her LIPs
    once every 16/3 steps)."""
    s = sched()
    for i in range(16):
        s.add(Call(f"a{i}", lip=i, user="alice", n_tokens=1, arrival=0))
    s.add(Call("b", lip=100, user="bob", n_tokens=1, arrival=1))
    first = s.schedule()
    assert comp(first) == [("a0", 0, 1), ("a1", 0, 1), ("a2", 0, 1), ("b", 0, 1)]
    again(s, first)
    assert comp(s.schedule()) == [("b", 0, 1), ("a3", 0, 1), ("a4", 0, 1), ("a5", 0, 1)]   # served least first
    s = sched()
    for i in range(16):
        s.add(Call(f"a{i}", lip=i, user="alice", n_tokens=1))
    s.add(Call("b", lip=100, user="bob", n_tokens=1))
    for _ in range(96):
        step = s.schedule()
        assert "b" in [c.key for c, _, _ in step.items] and len(step.items) == 4
        assert predicted(s, step) <= 1.5 * s.cost.seconds(2, 2) + 1e-12
        again(s, step)
    assert s.served_user["bob"] == 96 and s.served_user["alice"] == 3 * 96
    assert sorted(s.served_lip[i] for i in range(16)) == [18] * 16       # her 288 tokens, 18 each


def test_long_prompts_of_one_user_get_chunks_sized_to_the_decoder_beside_them():
    """Alice's 16 prompts of 3,000 tokens alone: two 128-token chunks a step (197 ms), her first
    prompts first.  With bob decoding: bob's token and a 5-token chunk of hers (10 ms <= 1.5 x 7,
    the even step)."""
    s = sched()
    for i in range(16):
        s.add(Call(f"p{i}", lip=i, user="alice", n_tokens=3000))
    assert comp(s.schedule()) == [("p0", 0, 128), ("p1", 0, 128)]
    s.add(Call("b", lip=100, user="bob", n_tokens=1))
    assert comp(s.schedule()) == [("b", 0, 1), ("p0", 128, 5)]           # her begun prompts first
    s.add(Call("b", lip=100, user="bob", n_tokens=1))
    assert comp(s.schedule()) == [("b", 0, 1), ("p0", 133, 5)]
    assert comp(s.schedule()) == [("p0", 138, 128), ("p1", 128, 128)]    # bob thinking: hers again


def test_a_light_users_prefill_sets_the_step_by_its_own_size():
    """Bob's 40-token prompt beside alice's prompts: the even step (40 tokens each) takes
    65.5 ms, so the shared step may take 98.25 ms: his 40 tokens and 83 of hers (97.75 ms)."""
    s = sched()
    for i in range(4):
        s.add(Call(f"p{i}", lip=i, user="alice", n_tokens=3000))
    s.add(Call("b", lip=100, user="bob", n_tokens=40))
    step = s.schedule()
    assert comp(step) == [("p0", 0, 83), ("b", 0, 40)]
    assert predicted(s, step) <= 1.5 * s.cost.seconds(80, 2)


def test_two_heavy_users_share_full_steps_half_and_half():
    s = sched(token_budget=64)
    for i in range(48):
        s.add(Call(f"a{i}", lip=i, user="alice", n_tokens=1))
        s.add(Call(f"c{i}", lip=100 + i, user="carol", n_tokens=1))
    step = s.schedule()
    users = [c.user for c, _, _ in step.items]
    assert len(users) == 64 and users.count("alice") == users.count("carol") == 32


def test_three_users_the_lightest_binds_and_the_middle_one_gets_all_it_asks():
    """Bob 1 decode, carol 2, alice 16: the even step (a token each) takes 8.5 ms, the shared
    one may take 12.75 ms = 5 calls: bob 1, then carol and alice an equal share of the 4 left
    (2 each, all carol asks).  With room for 4 calls (a steeper promise), 1.5 each: the whole
    token left over goes to the one served least (tokens / weight; a tie: by name)."""
    def three(alice_served, slowdown=1.5):
        s = sched(slowdown=slowdown)
        s.served_user["alice"] = alice_served
        for i in range(16):
            s.add(Call(f"a{i}", lip=i, user="alice", n_tokens=1))
        s.add(Call("b", lip=100, user="bob", n_tokens=1))
        s.add(Call("c0", lip=200, user="carol", n_tokens=1))
        s.add(Call("c1", lip=201, user="carol", n_tokens=1))
        return sorted(c.user for c, _, _ in s.schedule().items)
    assert three(0) == ["alice", "alice", "bob", "carol", "carol"]
    assert three(0, slowdown=10.5 / 8.5) == ["alice", "alice", "bob", "carol"]
    assert three(50, slowdown=10.5 / 8.5) == ["alice", "bob", "carol", "carol"]


def test_weights_by_priority_class():
    """Without a cost model (no step timed yet) the budget is shared 4:1 between an
    interactive and a normal user."""
    s = BatchScheduler(token_budget=10)
    for i in range(16):
        s.add(Call(f"a{i}", lip=i, user="alice", n_tokens=1, priority=1))
        s.add(Call(f"c{i}", lip=100 + i, user="carol", n_tokens=1, priority=0))
    users = [c.user for c, _, _ in s.schedule().items]
    assert users.count("alice") == 8 and users.count("carol") == 2


def test_only_the_highest_class_present_keeps_the_step_short():
    """A batch-class user's one decode does not narrow a normal user's steps (it still rides
    in each); an interactive user's does: the even step is then his alone (5.5 ms), and the
    shared one (<= 8.25 ms) carries his token and one of alice's."""
    s = sched()
    for i in range(16):
        s.add(Call(f"a{i}", lip=i, user="alice", n_tokens=1))
    s.add(Call("b", lip=100, user="bob", n_tokens=1, priority=-1))
    assert len(s.schedule().items) == 17
    s = sched()
    for i in range(16):
        s.add(Call(f"a{i}", lip=i, user="alice", n_tokens=1))
    s.add(Call("b", lip=100, user="bob", n_tokens=1, priority=1))
    step = s.schedule()
    assert comp(step)[0] == ("b", 0, 1) and len(step.items) == 2


def test_a_user_with_two_classes_gets_a_share_in_each():
    s = BatchScheduler(token_budget=4)
    s.add(Call("hi", lip=1, user="u", n_tokens=1, priority=1))
    s.add(Call("lo", lip=2, user="u", n_tokens=1, priority=-1))
    assert sorted(c.key for c, _, _ in s.schedule().items) == ["hi", "lo"]


def test_every_user_gets_a_token_even_when_one_step_is_too_slow():
    """A cost model so steep that no shared step fits: each user still gets one token."""
    s = sched(cost=StepCost.fixed(base=0.0, per_token=1.0, per_call=0.0), slowdown=1.0)
    for i in range(4):
        s.add(Call(f"a{i}", lip=i, user="alice", n_tokens=1))
    s.add(Call("b", lip=100, user="bob", n_tokens=1))
    assert sorted(c.user for c, _, _ in s.schedule().items) == ["alice", "bob"]


def test_split_is_weighted_max_min():
    d = [Demand("a", 0, [1] * 16, served=0), Demand("b", 0, [1], served=0), Demand("c", 0, [1] * 5, served=0)]
    assert split(d, 9) == {(0, "a"): 4, (0, "b"): 1, (0, "c"): 4}
    assert split(d, 100) == {(0, "a"): 16, (0, "b"): 1, (0, "c"): 5}
    d = [Demand("a", 1, [1] * 16), Demand("b", 0, [1] * 16), Demand("c", -1, [1] * 16)]
    assert split(d, 21) == {(1, "a"): 16, (0, "b"): 4, (-1, "c"): 1}
    # a whole token left over goes to the user served least (tokens / weight)
    d = [Demand("a", 0, [1] * 9, served=100), Demand("b", 0, [1] * 9, served=10)]
    assert split(d, 5) == {(0, "a"): 2, (0, "b"): 3}


def test_capacity_is_the_budget_alone_or_unknown_costs():
    d = [Demand("a", 0, [1] * 16), Demand("b", 0, [1])]
    assert capacity(d, 256, StepCost(), 2.0) == 17                     # nothing timed yet
    assert capacity(d[:1], 256, StepCost.fixed(**CPU), 2.0) == 16
    assert capacity(d, 10, None, 2.0) == 10
    assert capacity(d, 256, StepCost.fixed(**CPU), 1.5) == 4           # 4 + 1.5 x 4 = 10 <= 1.5 x 7
    assert capacity(d, 256, StepCost.fixed(**CPU), 3.0) == 11          # 4 + 1.5 x 11 = 20.5 <= 21
    even = [Demand("a", 0, [1] * 8), Demand("b", 0, [1] * 8)]
    assert capacity(even, 256, StepCost.fixed(**CPU), 1.5) == 16        # users who ask alike: all of it


# ---------------------------------------------------------------- the cost model
def test_cost_model_recovers_a_linear_device():
    m = StepCost()
    for tokens, calls in [(1, 1), (16, 16), (128, 1), (129, 2), (4, 4), (64, 3), (200, 20)]:
        m.observe(tokens, calls, 0.004 + 0.00075 * tokens + 0.00075 * calls)
    base, per_token, per_call, per_kpair, per_kread = m.coefficients()
    assert base == pytest.approx(0.004) and per_token == pytest.approx(0.00075)
    assert per_call == pytest.approx(0.00075) and per_kpair == per_kread == 0.0   # no attention seen


def test_cost_model_with_decodes_only_folds_the_call_into_the_token():
    m = StepCost()
    for w in (1, 2, 4, 8, 16, 4, 1):
        m.observe(w, w, 0.004 + 0.0015 * w)
    assert m.coefficients() == pytest.approx((0.004, 0.0015, 0.0, 0.0, 0.0))


def test_cost_model_of_one_step_size_is_the_line_through_the_origin():
    """One size seen (a user decoding 16 streams alone): a step half as wide is assumed to take
    half the time, the conservative guess that the narrower shared steps then correct."""
    m = StepCost()
    for _ in range(5):
        m.observe(16, 16, 0.028)
    assert m.coefficients() == pytest.approx((0.0, 0.028 / 16, 0.0, 0.0, 0.0))
    assert StepCost().seconds(1, 1) is None
    with pytest.raises(ValueError):
        StepCost(decay=0.0)
    with pytest.raises(ValueError):
        StepCost.fixed(-1.0, 0.0)


def test_cost_model_never_goes_negative():
    m = StepCost()
    for w, t in [(1, 0.010), (2, 0.009), (4, 0.008), (8, 0.007)]:        # noise: wider looked faster
        m.observe(w, w, t)
    base, per_token, per_call, per_kpair, per_kread = m.coefficients()
    assert base >= 0 and per_token > 0 and per_call >= 0 and per_kpair >= 0 and per_kread >= 0


def test_cost_model_learns_the_attention_over_the_context():
    """Steps whose cost depends on how deep in its file each call's tokens sit (the attention
    reads the whole context): the model recovers that term beside tokens and calls, and a few
    tokens deep in a long prompt are predicted to cost what they do."""
    m = StepCost()
    rows = [(1, 1, 50), (5, 2, 3000), (128, 1, 0), (128, 1, 2800), (17, 9, 400), (40, 3, 1200),
            (2, 2, 3000), (64, 4, 100), (9, 5, 1500)]
    for tokens, calls, ctx in rows:
        pairs = attention_pairs(ctx, tokens)
        m.observe(tokens, calls, pairs=pairs, seconds=0.004 + 0.0003 * tokens + 0.0002 * calls + 0.0004 * pairs)
    assert m.coefficients() == pytest.approx((0.004, 0.0003, 0.0002, 0.0004, 0.0))
    deep, shallow = m.seconds(5, 1, attention_pairs(3000, 5)), m.seconds(5, 1, attention_pairs(0, 5))
    assert deep > 2 * shallow
    assert attention_pairs(0, 1) == 0.001 and attention_pairs(10, 2) == pytest.approx(0.023)


def test_a_chunk_deep_in_a_long_prompt_is_kept_small_beside_a_decoder():
    """Bob decodes one sequence; alice's prompt is 3,000 tokens in. With the attention term the
    shared step gives her only as many tokens as keep the step within 1.5x the even step: his
    work once for each of them, priced as his (her deep tokens do not widen the step he is
    measured against)."""
    cost = StepCost.fixed(base=0.004, per_token=0.0003, per_call=0.0002, per_kpair=0.0004)
    bob = Demand("bob", 0, [1], 0, [40])
    alice = Demand("alice", 0, [128], 0, [3000])
    c = capacity([bob, alice], 256, cost, 1.5)
    shares = split([bob, alice], c)
    assert shares[bob.key] == 1 and 1 <= shares[alice.key] < 8
    step = cost.seconds(c, 2, bob.work(1)[1] + alice.work(shares[alice.key])[1])
    even = cost.seconds(2, 2, 2 * bob.work(1)[1])
    assert step <= 1.5 * even
    theirs = cost.seconds(2, 2, bob.work(1)[1] + alice.work(1)[1])    # one token each, as priced
    assert step < 1.5 * theirs
    flat = capacity([Demand("bob", 0, [1]), Demand("alice", 0, [128])], 256, cost, 1.5)   # no contexts given
    assert flat > c                                    # priced flat, her chunk would be wider


def test_a_chunk_deep_in_a_long_prompt_costs_no_more_than_one_at_its_start():
    """Alice alone, her prompt 3,000 tokens in: her chunk is cut so that the pass is predicted
    to cost what a full chunk at the prompt's start does (anyone arriving waits for it); shallow
    chunks and a model that has not seen attention cost are left at chunk_tokens."""
    cost = StepCost.fixed(base=0.004, per_token=0.0016, per_call=0.0, per_kpair=0.0007)
    s = BatchScheduler(token_budget=256, chunk_tokens=128, cost=cost)
    assert s.chunk_cap(0) == 128 and s.chunk_cap(10) == 128 and s.chunk_cap(500) == 128   # ordinary prompts
    deep = s.chunk_cap(3000)
    assert 32 <= deep < 80
    limit = 1.25 * (0.0016 * 128 + 0.0007 * attention_pairs(0, 128))
    assert 0.0016 * deep + 0.0007 * attention_pairs(3000, deep) <= limit
    assert 0.0016 * (deep + 1) + 0.0007 * attention_pairs(3000, deep + 1) > limit
    assert s.chunk_cap(10 ** 6) == 32                      # never under MIN_CHUNK
    s.add(Call(key="a", lip=1, user="alice", n_tokens=2000, context=3000))
    step = s.schedule()
    assert step.items[0][2] == deep
    flat = BatchScheduler(token_budget=256, chunk_tokens=128, cost=StepCost.fixed(**CPU))
    assert flat.chunk_cap(3000) == 128


def test_the_scheduler_learns_the_shared_width_from_the_steps_it_timed():
    """Alice's 16 streams alone, 28 ms a step (this CPU).  Bob arrives: the model knows one size,
    so the first shared step is 3 calls (1.75 ms a call, through the origin: 5.25 <= 1.5 x 3.5);
    timed at 8.5 ms, it teaches the model the step's fixed cost, and the shared steps widen to
    4 calls (10 ms)."""
    s = BatchScheduler(token_budget=256, chunk_tokens=128)
    device = lambda step: 0.004 + 0.0015 * len(step.items)              # noqa: E731
    for i in range(16):
        s.add(Call(f"a{i}", lip=i, user="alice", n_tokens=1))
    for _ in range(3):
        step = s.schedule()
        assert len(step.items) == 16
        s.took(device(step))
        again(s, step)
    s.add(Call("b", lip=100, user="bob", n_tokens=1))
    widths = []
    for _ in range(6):
        step = s.schedule()
        widths.append(len(step.items))
        s.took(device(step))
        again(s, step)
    assert widths[0] == 3 and widths[-3:] == [4, 4, 4]


def test_the_step_waits_for_the_light_users_caller_not_for_the_heavy_users_stragglers():
    """After a shared step, the next one waits (up to the gather window) for bob's caller to come
    back, never for alice's: she has more calls queued than her share takes."""
    s = sched(gather_s=0.003)
    for i in range(16):
        s.add(Call(f"a{i}", lip=i, user="alice", n_tokens=1))
    s.add(Call("b", lip=100, user="bob", n_tokens=1))
    step = s.schedule()
    assert set(s.last_step_keys) == {"b"}
    assert s.should_wait(now=1.0) is True                       # bob's next token is coming
    s.add(Call("b", lip=100, user="bob", n_tokens=1))
    assert s.should_wait(now=1.001) is False                    # alice's 3 callers: not waited for
    assert len(step.items) == 4


# ---------------------------------------------------------------- turns for a deep context
# One thread of this CPU: a step costs 10 ms, a token 1.5 ms, a call 0.5 ms; attention 0.8 ms a
# thousand query-key pairs and 4 ms a thousand keys read (one token 2,800 deep: 11 ms of reading)
DEEP = dict(base=0.010, per_token=0.0015, per_call=0.0005, per_kpair=0.0008, per_kread=0.004)


def test_cost_model_prices_the_keys_a_call_reads_at_the_measured_ratio():
    """A call reads its context's K/V once, whatever its tokens: with what a key's reading costs
    in pairs given (the kernel measures it on the device at start-up), the model fits the rest and
    prices one token 2,800 deep at a whole read of the context, as it does decodes alone; a new
    ratio forgets the steps fitted with the old one."""
    from symphony.sched.cost import attention_reads
    m = StepCost(read_pairs=5.0)
    rows = [(1, 1, 50), (5, 2, 3000), (128, 1, 0), (48, 1, 2800), (17, 9, 400), (40, 3, 1200),
            (2, 2, 3000), (64, 4, 100), (9, 5, 1500), (1, 1, 2800)]
    for tokens, calls, ctx in rows:
        a, r = attention_pairs(ctx, tokens), attention_reads(ctx, tokens)
        m.observe(tokens, calls, pairs=a, reads=r,
                  seconds=0.010 + 0.0015 * tokens + 0.0005 * calls + 0.0008 * a + 0.004 * r)
    assert m.coefficients() == pytest.approx(tuple(DEEP.values()))
    assert m.seconds(1, 1, attention_pairs(2800, 1), attention_reads(2800, 1)) == pytest.approx(0.02545, abs=1e-5)
    d = StepCost(read_pairs=5.0)
    for w, ctx in [(1, 40), (4, 300), (16, 900), (2, 100), (8, 2000)]:          # decodes: pairs = reads
        d.observe(w, w, 0.004 + 0.0015 * w + 0.006 * w * ctx / 1000, pairs=w * ctx / 1000, reads=w * ctx / 1000)
    assert d.coefficients() == pytest.approx((0.004, 0.0015, 0.0, 0.001, 0.005))
    d.set_read_pairs(5.0)
    assert d.steps == 5
    d.set_read_pairs(2.0)
    assert d.steps == 0 and d.seconds(1, 1) is None
    for bad in (-1.0, float("nan"), float("inf"), "5"):
        with pytest.raises(ValueError):
            StepCost(read_pairs=bad)


def test_a_prompt_deep_in_its_context_sits_out_but_for_turns_beside_a_decoder():
    """Bob decodes (40 deep); alice's prompt is 2,800 tokens in, so one token of hers would cost
    more than his whole step.  She sits out, earning half the time of each step she misses, and
    comes in with chunks of at least 32 tokens as her credit pays for them: bob is in every step,
    his steps average within 1.5x his own and one turn of hers, and she is never starved."""
    s = sched(cost=StepCost.fixed(**DEEP))
    s.add(Call("p", lip=1, user="alice", n_tokens=3000, context=2800))
    bob_alone = s.cost.seconds(1, 1, attention_pairs(40, 1), 0.041)
    times, hers = [], []
    for i in range(200):
        s.add(Call("b", lip=100, user="bob", n_tokens=1, context=40 + i))
        step = s.schedule()
        assert [c.user for c, _, _ in step.items][0] == "bob"
        times.append(s.cost.seconds(*[sum(x) for x in zip(*[(n, 1, attention_pairs(c.context + st, n),
                                                               (c.context + st + n) / 1000)
                                                              for c, st, n in step.items])]))
        hers += [n for c, _, n in step.items if c.user == "alice"]
    assert len(hers) >= 5 and min(hers) >= 32                          # turns, of real chunks
    turn = max(times)
    assert sum(times) / len(times) <= 1.5 * bob_alone + turn / 40
    assert turn < 0.2                                  # a turn: 32-36 tokens 2,800 deep, ~150 ms


def test_ordinary_users_never_sit_out():
    """Deferral is for a context's reading only: sixteen decodes, a fresh prompt, or a model that
    prices nothing by context leave every user in every shared step."""
    from symphony.sched.share import deferred
    cost = StepCost.fixed(**DEEP)
    bob = Demand("bob", 0, [1], 0, [40])
    assert deferred([bob, Demand("alice", 0, [1] * 16, 0, [300] * 16)], cost, 1.5) == set()
    assert deferred([bob, Demand("alice", 0, [128], 0, [0])], cost, 1.5) == set()
    assert deferred([bob, Demand("alice", 0, [48], 0, [2800])], StepCost.fixed(**CPU), 1.5) == set()
    assert deferred([bob, Demand("alice", 0, [48], 0, [2800])], cost, 1.5) == {(0, "alice")}
    assert deferred([bob], cost, 1.5) == set() and deferred([bob, bob], StepCost(), 1.5) == set()


def test_sitting_out_follows_the_priority_classes():
    """Only the highest class present sets whom a deep prompt would slow: a batch-class deep
    prompt sits out beside a normal decoder; an interactive one beside him does not (he is not of
    the highest class present, she is the lightest of it)."""
    from symphony.sched.share import deferred
    cost = StepCost.fixed(**DEEP)
    bob = Demand("bob", 0, [1], 0, [40])
    assert deferred([bob, Demand("alice", -1, [48], 0, [2800])], cost, 1.5) == {(-1, "alice")}
    assert deferred([bob, Demand("alice", 1, [48], 0, [2800])], cost, 1.5) == set()


def _work_by_loop(d: Demand, tokens: int):
    """What `Demand.work` means, written out: the calls ``tokens`` reach into, the last one cut."""
    from symphony.sched.cost import attention_reads
    n, pairs, reads = 0, 0.0, 0.0
    for i, size in enumerate(d.items):
        if tokens <= 0:
            break
        ctx = d.contexts[i] if i < len(d.contexts) else 0
        n += 1
        pairs += attention_pairs(ctx, min(size, tokens))
        reads += attention_reads(ctx, min(size, tokens))
        tokens -= size
    return n, pairs, reads


def test_demand_work_from_running_sums_equals_the_loop():
    import random
    rng = random.Random(7)
    for _ in range(300):
        k = rng.randint(1, 12)
        items = [rng.choice([0, 1, 1, 1, rng.randint(1, 600)]) for _ in range(k)]
        contexts = [rng.randint(0, 4000) for _ in range(rng.randint(0, k))]     # fewer contexts: 0 for the rest
        d = Demand("u", 0, items, 0, contexts)
        assert d.tokens == sum(items)
        for t in {-3, 0, 1, 2, sum(items) - 1, sum(items), sum(items) + 5, rng.randint(0, sum(items) + 1)}:
            assert d.work(t) == _work_by_loop(d, t), (items, contexts, t)
            assert d.calls(t) == _work_by_loop(d, t)[0]


def test_split_with_room_for_all_gives_each_its_demand():
    import random
    rng = random.Random(3)
    for _ in range(100):
        ds = [Demand(f"u{i}", rng.randint(-1, 1), [rng.randint(0, 40) for _ in range(rng.randint(1, 5))])
              for i in range(rng.randint(1, 6))]
        total = sum(d.tokens for d in ds)
        for cap in (total, total + rng.randint(1, 100)):
            assert split(ds, cap) == {d.key: d.tokens for d in ds}
