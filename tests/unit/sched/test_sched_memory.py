"""The device-memory planner (sched/memory.py): pure policy, on a model of a
pool -- who runs, who waits, who is suspended and resumed, in what order.
The planner calls nothing: it yields its moves and the pool here makes them."""
from __future__ import annotations

from symphony.sched.memory import LipMem, MemoryPlanner, Reclaim, Resume, Suspend, rank


class Pool:
    """A device pool of ``capacity`` pages; LIPs hold pages; a host tier of
    ``host`` slots takes suspended LIPs' pages (all or what fits)."""

    def __init__(self, capacity, held, host=1000, reclaimable=0):
        self.capacity, self.held, self.host, self.idle = capacity, dict(held), host, reclaimable
        self.swapped: dict = {}
        self.log: list = []

    def free(self):
        return self.capacity - sum(self.held.values()) - self.idle

    def reclaim(self, n):
        take = min(self.idle, max(0, n - self.free()))
        self.idle -= take
        self.log.append(("reclaim", take))
        return self.free()

    def suspend(self, i):
        n = min(self.held.get(i, 0), self.host)
        if n == 0:
            return None
        self.held[i] -= n
        self.host -= n
        self.swapped[i] = self.swapped.get(i, 0) + n
        self.log.append(("suspend", i))
        return n

    def resume(self, i):
        n = self.swapped.pop(i)
        self.host += n
        self.held[i] = self.held.get(i, 0) + n
        self.log.append(("resume", i))

    def make(self, move):
        """Make one of the planner's moves; its answer (pages free afterwards, or None)."""
        if isinstance(move, Reclaim):
            return self.reclaim(move.pages)
        if isinstance(move, Suspend):
            return None if self.suspend(move.lip) is None else self.free()
        assert isinstance(move, Resume)
        self.resume(move.lip)
        return self.free()

    def planner(self):
        return self

    def plan(self, lips, headroom=0, capacity=1 << 62):
        return drive(MemoryPlanner().plan(lips, self.free(), headroom, capacity), self.make)


def drive(planning, make):
    """Make each move the planner yields; its Plan."""
    try:
        move = next(planning)
        while True:
            move = planning.send(make(move))
    except StopIteration as done:
        return done.value


def lips(*specs):
    """(id, priority, admitted, device_pages, need) tuples."""
    return [LipMem(i, p, a, d, n) for i, p, a, d, n in specs]


def test_all_fit_nobody_moves():
    pool = Pool(10, {1: 3, 2: 3})
    plan = pool.planner().plan(lips((1, 0, 0, 3, 2), (2, 0, 1, 3, 2)))
    assert plan.run == [1, 2] and not plan.wait and not plan.suspend
    assert pool.log == []


def test_reclaim_comes_before_any_suspension():
    pool = Pool(10, {1: 4, 2: 4}, reclaimable=2)
    plan = pool.planner().plan(lips((1, 0, 0, 4, 2), (2, 0, 1, 4, 0)))
    assert plan.run == [1] and not plan.suspend
    assert pool.log == [("reclaim", 2)]


def test_the_least_important_is_suspended_for_a_more_important_one():
    pool = Pool(10, {1: 4, 2: 3, 3: 3})
    plan = pool.planner().plan(lips((1, 0, 0, 4, 3), (2, 0, 1, 3, 0), (3, 0, 2, 3, 1)))
    assert plan.suspend == [3]                   # latest admitted first; 2 keeps its pages
    assert plan.run == [1] and 3 not in plan.run


def test_a_lip_never_suspends_a_more_important_one_it_waits():
    pool = Pool(10, {1: 6, 2: 4})
    plan = pool.planner().plan(lips((1, 0, 0, 6, 0), (2, 0, 1, 4, 3)))
    assert plan.wait == [2] and not plan.suspend


def test_priority_class_beats_admission_order():
    pool = Pool(10, {1: 5, 2: 5})
    plan = pool.planner().plan(lips((1, -1, 0, 5, 1), (2, 1, 1, 5, 2)))
    assert plan.suspend == [1] and plan.run == [2]


def test_nobody_is_suspended_when_even_all_would_not_be_enough():
    pool = Pool(10, {1: 2, 2: 2, 3: 2})
    plan = pool.planner().plan(lips((1, 0, 0, 2, 9), (2, 0, 1, 2, 0), (3, 0, 2, 2, 0)))
    assert plan.wait == [1] and not plan.suspend


def test_a_waiting_lip_leaves_what_is_left_to_the_next():
    pool = Pool(10, {1: 6})
    plan = pool.planner().plan(lips((1, 0, 0, 6, 8), (2, 0, 1, 0, 3)))
    assert plan.wait == [1] and plan.run == [2]


def test_resume_needs_room_plus_headroom_and_keeps_order():
    pool = Pool(10, {1: 4})
    pool.swapped = {2: 3, 3: 2}
    ls = lips((1, 0, 0, 4, 0)) + [LipMem(2, 0, 1, 0, 1, True, 3), LipMem(3, 0, 2, 0, 1, True, 2)]
    plan = pool.planner().plan(ls, headroom=1)
    assert plan.resume == [2] and plan.run == [2] and plan.wait == [3]     # 3+1+1 fit; then 2+1+1 do not


def test_resume_within_a_class_does_not_push_running_lips_out():
    pool = Pool(10, {1: 4, 3: 6})
    pool.swapped = {2: 3}
    ls = [LipMem(1, 0, 0, 4, 0), LipMem(2, 0, 1, 0, 1, True, 3), LipMem(3, 0, 2, 6, 0)]
    plan = pool.planner().plan(ls)
    assert not plan.resume and not plan.suspend and plan.wait == [2]


def test_a_higher_class_resumes_by_suspending_a_lower_one():
    pool = Pool(10, {1: 4, 3: 6})
    pool.swapped = {2: 3}
    ls = [LipMem(1, 0, 0, 4, 0), LipMem(2, 1, 1, 0, 1, True, 3), LipMem(3, -1, 2, 6, 0)]
    plan = pool.planner().plan(ls)
    assert plan.suspend == [3] and plan.resume == [2]


def test_headroom_never_asks_for_more_than_the_pool():
    pool = Pool(8, {})
    pool.swapped = {1: 7}
    plan = pool.planner().plan([LipMem(1, 0, 0, 0, 1, True, 7)], headroom=5, capacity=8)
    assert plan.resume == [1]


def test_a_full_host_tier_means_waiting_not_a_crash():
    pool = Pool(10, {1: 5, 2: 5}, host=0)
    plan = pool.planner().plan(lips((1, 0, 0, 5, 2), (2, 0, 1, 5, 0)))
    assert plan.wait == [1] and not plan.suspend


def test_rank_is_priority_then_admission():
    ls = lips((1, 0, 5, 0, 0), (2, 1, 9, 0, 0), (3, 0, 2, 0, 0))
    assert [l.id for l in sorted(ls, key=rank)] == [2, 3, 1]


def test_new_work_waits_while_a_suspended_lip_waits_to_come_back():
    pool = Pool(10, {1: 8})
    pool.swapped = {2: 6}
    ls = [LipMem(1, 0, 0, 8, 0), LipMem(2, 0, 1, 0, 1, True, 6),
          LipMem(3, 0, 2, 0, 2, fresh=True), LipMem(4, 0, 3, 1, 1)]
    plan = pool.planner().plan(ls)
    assert plan.wait == [2, 3] and plan.run == [4]        # 4 is under way: it may go on
    pool.held[1] = 0                                      # 1 finished: 2 comes back first
    plan = pool.planner().plan(ls[1:])
    assert plan.resume == [2]


def test_the_planner_yields_its_moves_and_acts_on_the_answers():
    """Driven by hand: the planner asks for a reclaim, then a suspension; told
    the host took nothing (None), it tries the next victim; the plan comes last."""
    steps = MemoryPlanner().plan(lips((1, 0, 0, 2, 6), (2, 0, 1, 4, 0), (3, 0, 2, 4, 0)), free=2)
    assert next(steps) == Reclaim(6)
    assert steps.send(2) == Suspend(3)               # nothing reclaimed: the least important goes first
    assert steps.send(None) == Suspend(2)            # 3 could not be swapped out: the next one
    try:
        steps.send(6)
    except StopIteration as done:
        plan = done.value
    assert plan.run == [1] and plan.suspend == [2] and not plan.wait


# ---------------------------------------------------------------- shares between users
def test_a_user_within_its_share_suspends_the_lips_of_a_user_beyond_it():
    """Alice's 4 LIPs, admitted first, hold all 16 pages; bob's new LIP needs 2.  Without
    users it would wait for hers (it came last); with them alice is beyond her share (8 of
    16), so her last LIP goes out for it, and she may not push him out in turn."""
    ls = [LipMem(i, 0, i, 4, 1, user="alice") for i in range(1, 5)] + \
         [LipMem(9, 0, 9, 0, 2, fresh=True, user="bob")]
    pool = Pool(16, {1: 4, 2: 4, 3: 4, 4: 4})
    plan = pool.plan(ls, capacity=16)
    assert plan.suspend == [4] and plan.run == [9, 1, 2] and plan.wait == [3]
    anon = [LipMem(l.id, l.priority, l.admitted, l.device_pages, l.need, fresh=l.fresh) for l in ls]
    assert Pool(16, {1: 4, 2: 4, 3: 4, 4: 4}).plan(anon, capacity=16).wait == [9]   # one user: as before
    # bob now holds 2, alice 12 and a suspended LIP: alice's LIPs cannot take his pages
    ls = [LipMem(1, 0, 1, 6, 3, user="alice"), LipMem(2, 0, 2, 6, 0, user="alice"),
          LipMem(4, 0, 4, 0, 1, True, 4, user="alice"), LipMem(9, 0, 9, 2, 1, user="bob")]
    pool = Pool(16, {1: 6, 2: 6, 9: 2})
    pool.swapped = {4: 4}
    plan = pool.plan(ls, capacity=16)
    assert plan.run == [9, 1] and 9 not in plan.suspend and plan.suspend == [2] and plan.wait == [4]


def test_a_new_lip_within_its_share_starts_although_another_users_lip_waits_to_come_back():
    ls = [LipMem(1, 0, 1, 14, 1, user="alice"), LipMem(2, 0, 2, 0, 1, True, 6, user="alice"),
          LipMem(9, 0, 9, 0, 1, fresh=True, user="bob")]
    pool = Pool(16, {1: 14})
    pool.swapped = {2: 6}
    plan = pool.plan(ls, capacity=16)
    assert 9 in plan.run and plan.wait == [2]


def test_rank_puts_users_beyond_their_share_last_within_a_class():
    from symphony.sched.memory import over_share
    ls = [LipMem(1, 0, 1, 10, 0, user="a"), LipMem(2, 0, 2, 1, 0, user="b"), LipMem(3, 1, 3, 0, 0, user="a")]
    over = over_share(ls, 16)
    assert over == {"a"}
    assert [l.id for l in sorted(ls, key=lambda l: rank(l, over))] == [3, 2, 1]
    assert over_share(ls[:1], 4) == frozenset()                      # one user: no shares
