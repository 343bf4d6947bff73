"""perf/sim_routing.py, the routing simulation: its --quick run and its invariants."""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

import sim_routing as sim  # noqa: E402

COSTS = sim.COSTS["cpu"]


def small(alpha, n=4, queries=600, load=0.9, seed=3):
    return sim.workload(60, queries, alpha, n, load, COSTS, seed=seed)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "rows.json"
    assert sim.main(["--quick", "--plot", "", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def row(rows, alpha, n, policy):
    (r,) = [r for r in rows if r["alpha"] == alpha and r["n"] == n and r["policy"] == policy]
    return r


def test_quick_sweeps_every_point_and_says_it_is_a_simulation(quick, capsys):
    assert len(quick) == 4 * 2 * len(sim.POLICIES)       # alphas x N x policies
    assert {r["policy"] for r in quick} == set(sim.POLICIES)
    assert {r["n"] for r in quick} == {2, 8}
    assert any(math.isinf(r["alpha"]) for r in quick) and any(r["alpha"] == 0 for r in quick)
    for r in quick:
        assert 0 <= r["hit"] <= 1 and r["balance"] >= 1 and 0 < r["p50"] <= r["p99"]


def test_affinity_hits_at_least_as_often_as_random_under_skew(quick):
    for alpha in (1.13, 1.43):
        for n in (2, 8):
            assert row(quick, alpha, n, "affinity")["hit"] >= row(quick, alpha, n, "random")["hit"]
    assert row(quick, 1.13, 8, "affinity")["hit"] > row(quick, 1.13, 8, "random")["hit"] + 0.2


def test_one_hot_document_overloads_affinity_and_the_bound_spreads_it(quick):
    for p in sim.POLICIES:
        assert row(quick, 0, 8, p)["hit"] == 1.0          # one document: every kernel holds it once warm
    aff, bnd, least = (row(quick, 0, 8, p) for p in ("affinity", "bounded", "least"))
    assert aff["balance"] == pytest.approx(8.0)          # one kernel did everything
    assert bnd["balance"] < aff["balance"] and bnd["p99"] < aff["p99"]
    assert least["balance"] < 1.2


@pytest.mark.parametrize("policy", sim.POLICIES)
@pytest.mark.parametrize("alpha", [0, 1.13, math.inf])
def test_each_query_is_served_once_and_the_books_balance(policy, alpha):
    w = small(alpha)
    r = sim.simulate(w, 4, policy, COSTS, capacity=5)
    assert (r.served == 1).all()
    assert ((r.kernel >= 0) & (r.kernel < 4)).all()
    alone = COSTS.batch_time(w.question_tokens, 1, w.answer_tokens)
    assert (r.end - w.arrivals >= alone - 1e-9).all()     # nothing finishes faster than a hit alone
    assert r.max_lru <= 5
    docs = np.array(w.docs)
    assert (r.recomputed[r.hit] == 0).all()
    assert (r.recomputed[~r.hit] == w.doc_tokens[docs[~r.hit]]).all()
    assert r.busy.sum() <= r.end.max() * 4
    if policy == "affinity":                             # one kernel per document
        assert all(len(set(r.kernel[docs == d].tolist())) == 1 for d in set(w.docs))


def test_seeded_and_deterministic():
    a = sim.simulate(small(1.13), 4, "random", COSTS, capacity=5)
    b = sim.simulate(small(1.13), 4, "random", COSTS, capacity=5)
    assert (a.kernel == b.kernel).all() and (a.end == b.end).all()
    c = sim.simulate(small(1.13, seed=4), 4, "random", COSTS, capacity=5, seed=4)
    assert not (a.kernel == c.kernel).all()


def test_alpha_zero_is_one_document_and_finite_alpha_is_rag_skews_draw():
    assert len(set(sim.pick_docs(50, 200, 0, seed=1))) == 1
    assert sim.pick_docs(50, 200, 1.13, seed=1) == sim.draw(50, 200, 1.13, 1)
    uniform = sim.pick_docs(50, 5000, math.inf, seed=1)
    assert max(uniform.count(d) for d in range(50)) < 3 * 5000 / 50


def test_the_plot_is_written(quick, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sim.png"
    sim.plot(quick, str(out), "test")
    assert out.stat().st_size > 10_000


def test_the_shipped_policy_runs_the_gateways_own_router():
    from symphony.gateway import router
    assert sim.RoutingTable is router.RoutingTable and sim.request_keys is router.request_keys
    w = small(1.13, load=0.3)
    r = sim.simulate(w, 4, "shipped", COSTS, capacity=5, shipped=sim.Shipped(slack=32, entries=1000))
    assert (r.served == 1).all()
    docs = np.array(w.docs)                              # light load: a document's queries stay together
    assert all(len(set(r.kernel[docs == d].tolist())) == 1 for d in set(w.docs))
    assert r.router["affinity"] > 0.5 and r.router["entries"] <= 1000 and r.router["choose_us"] > 0


@pytest.mark.parametrize("policy", sim.POLICIES)
def test_a_failed_kernel_loses_its_batch_and_a_drained_one_takes_nothing_new(policy):
    w = small(1.13, n=4, queries=800, load=0.7)
    span = float(w.arrivals[-1])
    faults = sim.Faults(fail=0.3, drain=0.6, restart_s=span * 0.2)
    r = sim.simulate(w, 4, policy, COSTS, capacity=5, faults=faults)
    assert ((r.served == 1) | (r.served == 0)).all() and (r.served == 0).sum() <= COSTS.max_batch
    arrived = w.arrivals
    down = (arrived > 0.3 * span) & (arrived < 0.5 * span)
    assert not (r.kernel[down & (r.served == 1)] == 0).any()      # nothing new on the dead kernel
    assert not (r.kernel[arrived > 0.6 * span] == 1).any()       # nor on the drained one
    assert (r.kernel[arrived > 0.55 * span] == 0).any() or policy in ("affinity",)   # kernel 0 came back
