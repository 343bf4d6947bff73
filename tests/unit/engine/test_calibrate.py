"""qlinear's automatic choices by measured speed (symphony/engine/ops/calibrate.py): a table of
choices reaches qlinear and the layer stack (every path a choice may take gives the forced
path's outputs, within the tolerances of test_quant.py and tests/e2e/model/test_quant_engine.py),
a calibration gives a valid table, the cache round-trips, a corrupt, foreign or impossible cache
is ignored with one log line and never trusted, and switching calibration off restores the rule.

Tolerances, logits of the tiny quantized model vs the same model dequantized (test_quant_engine's
docstring): float paths 1e-4 of their scale, 15-bit paths (9, 11, 12) 1e-3, int8 paths 0.1.
"""
import contextlib
import json
import logging
import statistics
import time

import pytest
import torch

from conftest import random_weights, tiny_config
from symphony.engine import ops
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine
from symphony.engine.ops import build, calibrate, timing
from symphony.engine.quant import I8, U4, force_qlinear_path
from unit.engine.test_quant import assert_linear_close, assert_q8_close, expected_auto, gguf_weight

FLOAT_PATHS = (0, 1, 2, 3)
ROWS = tuple(b[0] for b in calibrate.BUCKETS)


@pytest.fixture(autouse=True)
def _rule_after(monkeypatch):
    """Each test starts and ends with no table in the ops (the rule) and no calibration setting."""
    ops.load()
    monkeypatch.delenv(calibrate.ENV, raising=False)
    calibrate.clear()
    yield
    calibrate.clear()


def table_of(mode: int, path: int) -> calibrate.Calibration:
    """Every cell of ``mode`` takes ``path``; the other mode's the dense GEMM (allowed to both)."""
    choices = {(md, k): [path if md == mode else 3] * len(ROWS) for md in calibrate.MODES
               for k in calibrate.KINDS}
    return calibrate.Calibration(ROWS, choices, {}, "calibrated")


def every_auto_path():
    ops.load()
    return [pytest.param(mode, p, id=f"{mode}:{p}") for mode in calibrate.MODES
            for p in calibrate.auto_paths(mode)]


# ------------------------------------------------------------------ the table reaches the kernels
@pytest.mark.parametrize("mode, path", every_auto_path())
def test_table_choice_is_the_forced_path_op(mode, path):
    """qlinear's automatic choice, with a table naming ``path`` in every bucket, runs ``path``
    bit for bit at row counts of every bucket, within the op-level tolerances."""
    calibrate.install(table_of(mode, path))
    for qtype in ("Q4_1", "Q8_0"):
        qw, want = gguf_weight(qtype, 37, 256)
        w = torch.from_numpy(want)
        for m in (1, 5, 40, 70):
            assert ops.qlinear_path_for(mode, m, 37, 256, qw.kind) == path
            x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
            with force_qlinear_path(mode):
                y = qw.linear(x)
            assert torch.equal(y, ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, path))
            if path in FLOAT_PATHS:
                assert_linear_close(y, x, w)
            elif path in ops.FIFTEEN_BIT_PATHS:                 # 15-bit x: test_quant's bound
                wd, xd = w.double(), x.double()
                err = (y.double() - xd @ wd.t()).abs()
                assert bool((err <= 3.1e-5 * (xd.abs() @ wd.abs().t()) + 1e-6).all())
            else:
                assert_q8_close(y, x, qw, w, path)


def _logits(eng, toks=(5, 17, 3, 99, 42, 8, 1)):
    """Logits of a 5-token prompt and two decode steps on a new sequence, [7, vocab]."""
    kv = eng.new_sequence()
    out = [eng.pred(kv, list(toks[:5]), all_logits=True)] + [eng.pred(kv, [t]).unsqueeze(0) for t in toks[5:]]
    eng.release(kv)
    return torch.cat(out)


@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_table_choice_reaches_the_layer_stack(quantize):
    """The model (one llama_layers call a pass) under each mode with a table naming each path
    it may take gives the logits of that path forced, within the engine-level tolerances of the
    dequantized model's."""
    w = random_weights(tiny_config(), seed=3)
    eng = Engine(w, None, EngineConfig(page_size=4, num_pages=64, quantize=quantize))
    assert eng.model.layer_stack is not None
    ref = _logits(Engine(eng.model.w.dequantized(), None, EngineConfig(page_size=4, num_pages=64)))
    scale = ref.abs().max()
    for mode in calibrate.MODES:
        for path in calibrate.auto_paths(mode):
            with force_qlinear_path(path):
                forced = _logits(eng)
            calibrate.install(table_of(mode, path))
            with force_qlinear_path(mode):
                auto = _logits(eng)
            calibrate.clear()
            assert torch.equal(auto, forced), (mode, path)
            tol = 1e-4 if path in FLOAT_PATHS else 1e-3 if path in ops.FIFTEEN_BIT_PATHS else 0.1
            assert (auto - ref).abs().max() <= tol * scale, (mode, path)


# ------------------------------------------------------------------ calibration
def test_calibration_gives_a_valid_table(monkeypatch):
    """A short calibration (smaller shape and fewer samples) times only paths a choice may take,
    picks per cell one the mode may take, the rule's or one whose time (`calibrate.low`) beats the
    rule's by the margin, and installed, qlinear's choices follow it bucket by bucket."""
    monkeypatch.setattr(calibrate, "SHAPE", (256, 128))
    monkeypatch.setattr(calibrate, "MIN_CLEAN", 3)
    calib = calibrate.measure(budget_s=30.0, wall_s=120.0)
    assert calib.source == "calibrated" and calib.complete and calib.rows == ROWS, calib.describe()
    for mode in calibrate.MODES:
        allowed = calibrate.auto_paths(mode)
        for kind in calibrate.KINDS:
            assert {q for (k, _, q) in calib.times if k == kind} <= set(calibrate.auto_paths(-1) + calibrate.auto_paths(-2))
            for (_, m, _), p in zip(calibrate.BUCKETS, calib.choices[(mode, kind)]):
                timed = {q: calib.times[(kind, m, q)] for q in allowed if (kind, m, q) in calib.times}
                rule = expected_auto_at(mode, m, kind)
                assert p in allowed and rule in timed, (mode, kind, m)
                assert calib.rules[(mode, kind)][ROWS.index(next(b[0] for b in calibrate.BUCKETS if b[1] == m))] == rule
                margin = calibrate.PROXY_MARGIN if m in calib.one_thread else calibrate.MARGIN
                assert p == rule or timed[p] * (1 + margin) < timed[rule], (mode, kind, m, p, timed)
    calibrate.install(calib)
    for mode in calibrate.MODES:
        for kind in calibrate.KINDS:
            for b, (first, _, _) in enumerate(calibrate.BUCKETS):
                last = calibrate.BUCKETS[b + 1][0] - 1 if b + 1 < len(ROWS) else 1000
                for m in (first, last):
                    assert ops.qlinear_path_for(mode, m, 64, 64, kind) == calib.choices[(mode, kind)][b]


def expected_auto_at(mode: int, m: int, kind: int) -> int:
    """The rule's choice for the calibration's shape (the table cleared)."""
    return ops.qlinear_path_for(mode, m, calibrate.SHAPE[0], calibrate.SHAPE[1], kind)


def test_choose_needs_a_clear_win_over_the_rule():
    """A path replaces the rule's only if its time (the lower quartile of its samples) beats the
    rule's by the margin and it is the faster in `WIN` of the pairs of their samples; among
    several such, the lowest;
    otherwise (a near tie, an overlap, a slower path, the rule's not timed or too few samples)
    the rule's."""
    allowed = calibrate.auto_paths(-1)
    rule = ops.qlinear_path_for(-1, 1, *calibrate.SHAPE, U4)
    other, third = [p for p in allowed if p != rule][:2]

    def pick(rule_s, other_s, third_s=None, margin=calibrate.MARGIN):
        s = {(U4, 1, rule): rule_s, (U4, 1, other): other_s}
        if third_s:
            s[(U4, 1, third)] = third_s
        return calibrate._choose(-1, U4, 1, allowed, s, margin)
    assert pick([10] * 5, [5] * 5) == other
    assert pick([10] * 5, [5] * 5, [4] * 5) == third                      # the lowest of the winners
    assert pick([10] * 5, [5] * 5, [4, 4, 4, 11, 11]) == other            # (that one overlaps)
    assert pick([10] * 5, [9.9] * 5) == rule                              # within the margin
    assert pick([10] * 5, [9] * 5, margin=calibrate.PROXY_MARGIN) == rule  # timed at one thread
    assert pick([10] * 5, [9, 9, 9, 11, 11]) == rule                      # overlapping
    assert pick([5] * 5, [10] * 5) == rule                                # slower
    assert pick([10] * 5, [5] * (calibrate.MIN_CLEAN - 1)) == rule        # too few samples
    assert calibrate._choose(-1, U4, 1, allowed, {(U4, 1, other): [1.0] * 5}) == rule    # no baseline


def test_the_open_ended_range_leaves_a_dense_choice_only_for_a_path_that_wins_throughout():
    """From 128 rows on (timed at 128 and 512 rows, standing for every larger step, a 1,500-token
    prefill say, where a GEMM's lead over the tile kernels grows): a dense rule choice is left
    for tiles only where the tiles beat it at both; for another GEMM freely; the bucket before
    the range stays free."""
    lo, hi = calibrate.TAIL
    assert [b[1] for b in calibrate.BUCKETS[-2:]] == [lo, hi]
    for mode in (-1, -2):
        allowed = calibrate.auto_paths(mode)
        rules = [ops.qlinear_path_for(mode, m, *calibrate.SHAPE, U4) for m in (lo, hi)]
        if any(r not in calibrate.DENSE_PATHS for r in rules):
            continue                                      # (no dense rule here on this CPU)
        tiles = [p for p in allowed if p not in calibrate.DENSE_PATHS][0]
        s = {(U4, lo, rules[0]): [10.0] * 5, (U4, lo, tiles): [5.0] * 5,     # tiles win at 128 ...
             (U4, hi, rules[1]): [40.0] * 5, (U4, hi, tiles): [45.0] * 5}    # ... not at 512
        assert calibrate._choose(mode, U4, lo, allowed, s) == rules[0]
        assert calibrate._choose(mode, U4, hi, allowed, s) == rules[1]
        s[(U4, hi, tiles)] = [30.0] * 5                   # at both: the tiles, in both buckets
        assert calibrate._choose(mode, U4, lo, allowed, s) == tiles
        assert calibrate._choose(mode, U4, hi, allowed, s) == tiles
        s.pop((U4, hi, tiles))                            # not timed at 512: not shown to win there
        assert calibrate._choose(mode, U4, lo, allowed, s) == rules[0]
        other = [p for p in allowed if p in calibrate.DENSE_PATHS and p != rules[0]]
        if other:                                         # another GEMM may win a bucket alone
            s[(U4, lo, other[0])] = [4.0] * 5
            assert calibrate._choose(mode, U4, lo, allowed, s) == other[0]
        below = calibrate.BUCKETS[-3][1]                  # the bucket before: measured freely
        rule_below = ops.qlinear_path_for(mode, below, *calibrate.SHAPE, U4)
        s = {(U4, below, rule_below): [10.0] * 5, (U4, below, tiles): [5.0] * 5}
        assert calibrate._choose(mode, U4, below, allowed, s) in (tiles, rule_below)
        if rule_below != tiles:
            assert calibrate._choose(mode, U4, below, allowed, s) == tiles


def test_kept_sets_aside_samples_that_waited_and_outliers():
    """`timing.kept`: a sample whose other threads waited for a core more than the allowance is
    set aside, and so are outliers beyond 3 MADs of the median."""
    samples = [(1.0, 0.0)] * 6 + [(1.02, 0.05), (3.0, 0.0), (1.0, 0.5)]
    assert timing.kept(samples, clean=0.1) == [1.0] * 6 + [1.02]
    assert timing.wins([1, 2], [3, 1.5]) == 0.75


def test_interleaved_drops_slow_keys_and_stops_when_enough_are_kept():
    """`timing.interleaved` prunes a key whose fastest sample is beyond ``prune`` times the
    fastest (not one in ``keep``), and stops once every key left has ``min_kept`` samples."""
    def spin(s):
        def f():
            t = time.thread_time()
            while time.thread_time() - t < s:
                pass
        return f
    fns = {"fast": spin(2e-4), "slow": spin(2e-3), "kept": spin(2e-3)}
    got, total = timing.interleaved(fns, min_kept=4, max_rounds=50, keep=frozenset({"kept"}), prune=3.0)
    assert len(got["slow"]) <= 1 and len(got["fast"]) >= 4 and len(got["kept"]) >= 4
    assert total < 50 * 3
    assert abs(statistics.median(got["fast"]) - 2e-4) < 1e-4


# ------------------------------------------------------------------ the cache
@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """The cache in tmp_path; a measurement that takes no time and counts its calls (every cell
    the dense GEMM, which every CPU runs and both modes may take)."""
    monkeypatch.setattr(build, "loaded_build", (tmp_path, build.loaded_build[1]))
    calls = []

    def fake_measure(budget_s=calibrate.BUDGET_S):
        calls.append(budget_s)
        choices = {(md, k): [3] * len(ROWS) for md in calibrate.MODES for k in calibrate.KINDS}
        return calibrate.Calibration(ROWS, choices, {(U4, 1, 3): 1e-4}, "calibrated", True, True, 0.01)
    monkeypatch.setattr(calibrate, "measure", fake_measure)
    return tmp_path / f"qlinear-calibration-{torch.get_num_threads()}t.json", calls


def test_cache_round_trips(fake_build, caplog):
    path, calls = fake_build
    caplog.set_level(logging.INFO, logger="symphony.ops")
    first = calibrate.ensure()
    assert calls and first.source == "calibrated" and first.cache == path and path.is_file()
    assert "calibrated in" in caplog.text and "-1 u4: 1 3, 2-3 3, 4-15 3, 16-31 3, 32-63 3, 64-127 3, 128-255 3, 256+ 3" in caplog.text
    assert calibrate.ensure() is first and len(calls) == 1                  # once per process
    calibrate.clear()
    caplog.clear()
    again = calibrate.ensure()
    assert len(calls) == 1 and again.source == "cache"
    assert (again.rows, again.choices, again.times) == (first.rows, first.choices, first.times)
    assert f"from the cache {path}" in caplog.text
    assert ops.qlinear_path_for(-1, 1, 64, 64, U4) == 3                      # installed
    assert not list(path.parent.glob("*.tmp"))                               # written by rename
    # read directly: the same calibration
    read = calibrate.read_cache(path, calibrate.cache_key(torch.get_num_threads()))
    assert read is not None and read.choices == first.choices


def _warnings(caplog, path) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name == "symphony.ops" and str(path) in r.getMessage()]


def _valid_cache(path, choices=None, **key_over):
    key = dict(calibrate.cache_key(torch.get_num_threads()), **key_over)
    data = {"key": key, "rows": list(ROWS), "times_s": {},
            "choices": {str(md): {str(k): (choices or {}).get((md, k), [3] * len(ROWS))
                                  for k in calibrate.KINDS} for md in calibrate.MODES}}
    path.write_text(json.dumps(data))


# every path the float choice (-1) may take on some CPU (csrc/cpu/qlinear.cpp, auto_may_take)
FLOAT_CHOICE_PATHS = (0, 1, 2, 3, 9, 11, 12)
UNKNOWN_PATH = 14                       # a path number no CPU has: qlinear knows -2..13


def _lacking_float_path() -> int:
    """A path the float choice (-1) may take on some CPU but not on this one; the test is skipped
    on a CPU that runs them all (AVX-512 VNNI and AVX2: a Sapphire Rapids Xeon, a Zen 4)."""
    lacking = [p for p in FLOAT_CHOICE_PATHS if p not in calibrate.auto_paths(-1)]
    if not lacking:
        pytest.skip(f"this CPU runs every path the float choice may take {FLOAT_CHOICE_PATHS}: "
                    "no cache from a better-equipped CPU to imitate (unknown-path checks the same)")
    return lacking[0]


def _impossible_path(which: str) -> int:
    return UNKNOWN_PATH if which == "unknown" else _lacking_float_path()


def test_float_choice_paths_are_the_ops():
    """FLOAT_CHOICE_PATHS above is what the op allows: this CPU's float choice is a subset."""
    assert set(calibrate.auto_paths(-1)) <= set(FLOAT_CHOICE_PATHS)
    assert UNKNOWN_PATH not in calibrate.auto_paths(-1) + calibrate.auto_paths(-2)


@pytest.mark.parametrize("bad", ["corrupt", "truncated", "foreign-cpu", "other-threads", "other-build",
                                 "lacking-path", "unknown-path", "wrong-mode-path", "bad-buckets"])
def test_bad_cache_is_ignored_with_one_log_line(fake_build, caplog, bad):
    path, calls = fake_build
    if bad == "corrupt":
        path.write_text("{not json")
    elif bad == "truncated":
        _valid_cache(path)
        path.write_text(path.read_text()[:40])
    elif bad == "foreign-cpu":
        _valid_cache(path, cpu=dict(calibrate.cpu_identity(), model_name="Some Other CPU", flags="0" * 16))
    elif bad == "other-threads":
        _valid_cache(path, threads=torch.get_num_threads() + 7)
    elif bad == "other-build":
        _valid_cache(path, build="0123456789abcdef")
    elif bad in ("lacking-path", "unknown-path"):
        _valid_cache(path, {(-1, U4): [_impossible_path(bad.split("-")[0])] + [3] * (len(ROWS) - 1)})
    elif bad == "wrong-mode-path":                      # an int8 kernel for the float choice
        _valid_cache(path, {(-1, I8): [3, 3, 4] + [3] * (len(ROWS) - 3)})
    else:
        data = json.loads((_valid_cache(path), path.read_text())[1])
        data["rows"] = [1, 2, 16, 64]
        path.write_text(json.dumps(data))
    caplog.set_level(logging.INFO, logger="symphony.ops")
    calib = calibrate.ensure()
    assert len(_warnings(caplog, path)) == 1, caplog.text
    assert calls, "a cache that cannot be trusted was used"
    assert calib.source == "calibrated"
    fresh = json.loads(path.read_text())                # replaced by the fresh calibration
    assert fresh["key"] == calibrate.cache_key(torch.get_num_threads())


@pytest.mark.parametrize("which", ["lacking", "unknown"])
def test_lacking_path_is_never_installed(fake_build, caplog, which):
    """Even read directly, a cache naming a path this CPU lacks (or no CPU has) gives no table."""
    path, _ = fake_build
    lacking = _impossible_path(which)
    _valid_cache(path, {(-1, U4): [lacking] * len(ROWS)})
    caplog.set_level(logging.INFO, logger="symphony.ops")
    assert calibrate.read_cache(path, calibrate.cache_key(torch.get_num_threads())) is None
    assert f"path(s) [{lacking}]" in caplog.text
    with pytest.raises(RuntimeError, match="qlinear_set_auto"):            # nor by the op itself
        calibrate.install(calibrate.Calibration(ROWS, {(md, k): [lacking if md == -1 else 3] * len(ROWS)
                                                       for md in calibrate.MODES for k in calibrate.KINDS},
                                                {}, "cache"))


def test_force_recalibrates_and_off_restores_the_rule(fake_build, monkeypatch, caplog):
    path, calls = fake_build
    rule = {(mode, m, kind): ops.qlinear_path_for(mode, m, 1536, 576, kind)
            for mode in calibrate.MODES for m in (1, 8, 48, 128) for kind in calibrate.KINDS}
    _valid_cache(path)
    assert calibrate.ensure().source == "cache" and not calls
    monkeypatch.setenv(calibrate.ENV, "force")
    assert calibrate.ensure().source == "calibrated" and len(calls) == 1
    assert ops.qlinear_path_for(-1, 1, 1536, 576, U4) == 3
    monkeypatch.setenv(calibrate.ENV, "off")
    caplog.set_level(logging.INFO, logger="symphony.ops")
    off = calibrate.ensure()
    assert off.source == "off" and len(calls) == 1 and f"{calibrate.ENV}=off" in caplog.text
    for (mode, m, kind), p in rule.items():
        assert ops.qlinear_path_for(mode, m, 1536, 576, kind) == p
    # the rule test_quant.py writes down, for a weight of 3 * 2^18 weights and more
    qw, _ = gguf_weight("Q8_0", 1536, 512)
    for m in (1, 8, 40, 64):
        for mode in calibrate.MODES:
            assert ops.qlinear_path_for(mode, m, 1536, 512, qw.kind) == expected_auto(mode, m, qw)
    monkeypatch.setenv(calibrate.ENV, "sometimes")
    with pytest.raises(ValueError, match=calibrate.ENV):
        calibrate.ensure()


def test_engine_calibrates_only_quantized_cpu_models(fake_build, caplog):
    """Engine.calibrate_kernels: a float model needs nothing; a quantized one installs and logs
    the choices, then the kernels a matrix takes by rows."""
    path, calls = fake_build
    caplog.set_level(logging.INFO)
    dense = Engine(random_weights(tiny_config(), seed=0), None, EngineConfig(page_size=4, num_pages=16))
    assert dense.calibrate_kernels() is None and not calls
    q = Engine(random_weights(tiny_config(), seed=0), None, EngineConfig(page_size=4, num_pages=16, quantize="int8"))
    assert q.calibrate_kernels().source == "calibrated" and len(calls) == 1
    assert "qlinear paths by rows" in caplog.text
    assert "quantized weights: automatic choice (--activations auto): any number of rows: dense" in caplog.text


@pytest.mark.parametrize("load, recalibrated", [(1.5, False), (0.0, True)])
def test_provisional_cache_is_measured_again_once_the_box_is_quiet(fake_build, monkeypatch, caplog, load,
                                                                   recalibrated):
    """A calibration taken on a busy box is cached marked provisional: a start on a box still
    busy uses it; one on a quiet box measures again and caches that."""
    path, calls = fake_build
    _valid_cache(path)
    data = json.loads(path.read_text())
    data.update(quiet=False, load_cores=1.8)
    path.write_text(json.dumps(data))
    monkeypatch.setattr(timing, "box_load", lambda window_s=0.2: load)
    caplog.set_level(logging.INFO, logger="symphony.ops")
    calib = calibrate.ensure()
    assert (calib.source == "calibrated") == recalibrated and len(calls) == int(recalibrated)
    assert ("provisional and the box is quiet" in caplog.text) == recalibrated
    if recalibrated:
        assert json.loads(path.read_text())["quiet"] is True
    else:
        assert calib.provisional and "provisional" in caplog.text


def test_measure_records_the_load_and_is_provisional_on_a_busy_box(monkeypatch):
    """measure() records the other processes' load over its run; above QUIET_CORES the result
    is provisional, and the log line says so."""
    monkeypatch.setattr(calibrate, "SHAPE", (64, 64))
    monkeypatch.setattr(calibrate, "MIN_CLEAN", 3)
    monkeypatch.setattr(calibrate.timing, "others_load", lambda a, b: 1.7)
    calib = calibrate.measure(budget_s=30.0, wall_s=120.0)
    assert calib.load == 1.7 and not calib.quiet and calib.provisional
    assert "other processes' load 1.7 cores" in calib.describe() and "provisional" in calib.describe()


def test_a_path_dropped_after_one_round_is_not_timed_in_larger_buckets(monkeypatch):
    """A path far slower than its mode's fastest is dropped within a bucket after one sample;
    the larger buckets must not time it again (a scalar kernel at 512 rows took seconds of the
    budget, and left buckets unmeasured). The pruning is per mode: the float-accurate paths are
    weighed against the fastest float path, not against the int8 kernels."""
    timed: dict[int, set] = {}
    slow, fast_float, fast_int8, other_float = 101, 102, 103, 104

    def fake_bucket(fns, calls, rules, limits):
        m = current["m"]
        timed.setdefault(m, set()).update(fns)
        cost = {slow: 50.0, fast_float: 2.0, fast_int8: 0.5, other_float: 3.0}
        got = {p: [cost.get(p, 1.0)] * (1 if p == slow else calibrate.MIN_CLEAN) for p in fns}
        return got, sum(len(s) for s in got.values())

    current = {"m": 0}

    def cycling(x, ws, kind, p):
        current["m"] = x.shape[0]
        return lambda: None
    monkeypatch.setattr(calibrate, "_time_bucket", fake_bucket)
    monkeypatch.setattr(calibrate, "qlinear_cycling", cycling)
    monkeypatch.setattr(calibrate, "auto_paths", lambda mode: [slow, fast_float, other_float] if mode == -1
                        else [fast_int8])
    monkeypatch.setattr(calibrate, "_rule", lambda mode, m, kind: fast_float if mode == -1 else fast_int8)
    monkeypatch.setattr(calibrate, "SHAPE", (64, 64))
    calibrate.measure(budget_s=30.0, wall_s=60.0)
    first = calibrate.BUCKETS[0][1]
    assert slow in timed[first]                                   # timed once, 25x the float path
    assert all(slow not in timed[b[1]] for b in calibrate.BUCKETS[1:])
    assert all(other_float in timed[b[1]] for b in calibrate.BUCKETS)  # 6x int8's, 1.5x float's: kept


@pytest.mark.parametrize("set_aside", [False, True])
def test_a_share_run_out_is_not_taken_for_cores_taken(monkeypatch, set_aside):
    """A bucket whose team timing ends short of MIN_CLEAN samples with nearly all of them kept ran
    out of its share (slow paths at many rows: 4 samples of ~6 ms each in a 115 ms share on a Zen
    4): the team goes on in the half kept for one thread, and the rows are not timed at one thread.
    Short because samples were set aside (the team waited for cores): one thread, as before."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    calls = {"team": 0, "one": 0}
    in_one = {"on": False}

    @contextlib.contextmanager
    def one_thread(n):
        in_one["on"] = True
        yield
        in_one["on"] = False

    def fake_bucket(fns, n_calls, rules, limits):
        if in_one["on"]:
            calls["one"] += 1
            return {p: [1e-4] * calibrate.MIN_CLEAN for p in fns}, calibrate.MIN_CLEAN * len(fns)
        calls["team"] += 1
        short = calibrate.MIN_CLEAN - 2                  # the first try of every bucket ends short
        got = {p: [1e-4] * (short if calls["team"] % 2 else calibrate.MIN_CLEAN) for p in fns}
        kept = sum(map(len, got.values()))
        return got, kept * (3 if set_aside and calls["team"] % 2 else 1)
    monkeypatch.setattr(calibrate, "_time_bucket", fake_bucket)
    monkeypatch.setattr(calibrate.timing, "torch_threads", one_thread)
    monkeypatch.setattr(calibrate, "qlinear_cycling", lambda x, ws, kind, p: (lambda: None))
    monkeypatch.setattr(calibrate, "SHAPE", (64, 64))
    calib = calibrate.measure(budget_s=30.0, wall_s=60.0)
    if set_aside:
        assert calib.one_thread and calls["one"] > 0
    else:
        assert calib.one_thread == () and calls["one"] == 0 and calib.complete
        assert calls["team"] == 2 * len(calibrate.BUCKETS) * len(calibrate.MODES) * len(calibrate.KINDS)


@pytest.mark.parametrize("again_one_thread", [False, True])
def test_a_team_timed_at_one_thread_is_measured_again_once(fake_build, monkeypatch, caplog, again_one_thread):
    """A calibration whose rows were timed at one thread for a team (its cores taken), on a box
    that was quiet, is cached provisional: the next start on a quiet box measures again. If that
    one is timed at one thread too, it is kept (``retried``): later starts use it, however many."""
    path, calls = fake_build
    _valid_cache(path)
    data = json.loads(path.read_text())
    data.update(quiet=True, load_cores=0.03, one_thread=[1, 2, 8])
    path.write_text(json.dumps(data))
    assert calibrate.read_cache(path, calibrate.cache_key(torch.get_num_threads())).provisional
    monkeypatch.setattr(timing, "box_load", lambda window_s=0.2: 0.0)
    measured = calibrate.measure

    def measure_proxied(budget_s=calibrate.BUDGET_S):
        calib = measured(budget_s)
        calib.one_thread = (1, 2, 8) if again_one_thread else ()
        return calib
    monkeypatch.setattr(calibrate, "measure", measure_proxied)
    caplog.set_level(logging.INFO, logger="symphony.ops")
    calib = calibrate.ensure()
    assert calib.source == "calibrated" and len(calls) == 1 and "provisional and the box is quiet" in caplog.text
    cached = json.loads(path.read_text())
    assert cached["retried"] is again_one_thread and cached["one_thread"] == ([1, 2, 8] if again_one_thread else [])
    assert not calib.provisional
    for _ in range(3):                                   # every later start: the cache, not measured again
        calibrate.clear()
        assert calibrate.ensure().source == "cache" and len(calls) == 1
