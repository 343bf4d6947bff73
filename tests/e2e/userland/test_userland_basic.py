"""The LIP standard library (sampling, helpers) and the stock programs
userland/complete.py, chat.py and beam.py."""
import json
import random
import re

import numpy as np
import pytest

from conftest import REPO, KernelProc, cpu_kernel_only
from symphony.lip.helpers import StopChecker
from symphony.lip.sampling import Sampler, log_softmax

P4 = np.log(np.array([0.5, 0.3, 0.15, 0.05]))          # logits of a known distribution


def support(s: Sampler, logits, history=()):
    return set(np.flatnonzero(s.probs(logits, history)).tolist())


# ---------------------------------------------------------------- Sampler (no kernel)
def test_sampler_seeded_reproducible_and_distributed():
    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)

    def draw(seed):
        s = Sampler(top_p=0.9, seed=seed)
        return [s.sample(logits) for _ in range(200)]
    assert draw(3) == draw(3)
    assert draw(3) != draw(4)
    s = Sampler(seed=0)
    counts = np.bincount([s.sample(P4) for _ in range(4000)], minlength=4) / 4000
    assert np.abs(counts - [0.5, 0.3, 0.15, 0.05]).max() < 0.03


def test_filters_leave_exactly_the_right_candidates():
    logits = np.array([1.0, 5.0, 3.0, 4.0, 2.0])
    assert support(Sampler(top_k=2), logits) == {1, 3}
    assert support(Sampler(top_k=1), logits) == {1}
    assert support(Sampler(top_k=0), logits) == {0, 1, 2, 3, 4}
    assert support(Sampler(top_k=2), [1.0, 3.0, 3.0, 0.0]) == {1, 2}     # ties with the k-th kept
    assert support(Sampler(top_p=0.45), P4) == {0}
    assert support(Sampler(top_p=0.79), P4) == {0, 1}                   # 0.5 + 0.3 >= 0.79
    assert support(Sampler(top_p=0.81), P4) == {0, 1, 2}
    assert support(Sampler(top_p=1.0), P4) == {0, 1, 2, 3}
    assert support(Sampler(min_p=0.35), P4) == {0, 1}                   # p >= 0.175
    assert support(Sampler(min_p=0.2), P4) == {0, 1, 2}                 # p >= 0.1
    assert support(Sampler(top_k=3, top_p=0.9), P4) == {0, 1, 2}        # after top-k: .53 .32 .16
    assert support(Sampler(top_k=3, top_p=0.8), P4) == {0, 1}           # .53 + .32 >= .8
    p = Sampler(top_k=3).probs(P4)
    assert np.allclose(p, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])   # renormalised
    s = Sampler(top_p=0.79, seed=1)
    assert {s.sample(P4) for _ in range(300)} == {0, 1}


def test_temperature_masks_and_greedy():
    logits = np.array([0.5, 2.0, -1.0, 1.9], dtype=np.float32)
    assert np.allclose(Sampler(temperature=2.0).probs(logits), np.exp(log_softmax(logits / 2.0)))
    assert Sampler(temperature=0.5).probs(logits).max() > Sampler(temperature=1.0).probs(logits).max()
    g = Sampler(temperature=0)
    assert g.greedy and all(g.sample(logits) == 1 for _ in range(20))
    masked = logits.copy()
    masked[[1, 3]] = -np.inf
    s = Sampler(seed=5)
    assert {s.sample(masked) for _ in range(200)} == {0, 2}
    assert logits[1] == 2.0                                              # input never written


def test_repetition_penalty():
    logits = np.array([2.0, -1.0, 1.5, 0.5])
    s = Sampler(temperature=0, repetition_penalty=2.0)
    assert not s.greedy
    assert np.allclose(s.penalize(logits, [0, 1, 1]), [1.0, -2.0, 1.5, 0.5])
    assert s.sample(logits) == 0 and s.sample(logits, history=[0]) == 2
    p0, p1 = Sampler().probs(logits)[0], Sampler(repetition_penalty=1.3).probs(logits, [0])[0]
    assert p1 < p0
    assert Sampler(repetition_penalty=0.5).probs(logits, [3])[3] > Sampler().probs(logits)[3]


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(temperature=float("nan")),
                                dict(temperature="1"), dict(top_k=-1), dict(top_k=2.5), dict(top_k=True),
                                dict(top_p=0.0), dict(top_p=1.5), dict(min_p=-0.1), dict(min_p=1.1),
                                dict(repetition_penalty=0.0), dict(seed=-1), dict(seed="x")])
def test_bad_sampler_parameters_raise(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        Sampler(**kw)


def test_bad_logits_raise():
    s = Sampler(seed=0, repetition_penalty=1.2)
    for bad in (np.zeros((2, 3)), np.array([np.nan, 1.0]), np.full(3, -np.inf), np.array([np.inf, 0.0])):
        with pytest.raises(ValueError, match="logits"):
            s.sample(bad)
    with pytest.raises(ValueError, match="history"):
        s.sample(np.zeros(4), history=[7])


# ---------------------------------------------------------------- StopChecker (no kernel)
def test_stop_string_across_chunks_is_never_partially_emitted():
    sc = StopChecker(["</s>"])
    assert sc.push("Hello <") == ("Hello ", False)
    assert sc.push("/") == ("", False)
    assert sc.push("s> more") == ("", True)
    assert sc.push("again") == ("", True) and sc.flush() == ""
    sc = StopChecker(["</s>"])
    assert sc.push("a <") == ("a ", False) and sc.push("b") == ("<b", False)   # a false alarm
    assert sc.push("x </") == ("x ", False) and sc.flush() == "</"            # end of stream
    sc = StopChecker(["bc", "abcd"])
    assert sc.push("xab") == ("x", False) and sc.push("cd") == ("", True)     # "abcd" starts first
    text, rng = "the quick STOP brown STOP fox", random.Random(0)
    for _ in range(50):                                    # random chunkings
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        sc, out = StopChecker(["STOP", "xyz"]), []
        for c in chunks:
            emit, stop = sc.push(c)
            assert "S" not in emit                          # no part of the stop string, ever
            out.append(emit)
            if stop:
                break
        assert "".join(out) == "the quick " and stop
    with pytest.raises(ValueError):
        StopChecker([""])


# ---------------------------------------------------------------- complete / chat on SmolLM2
PROMPT = "The three primary colors are"


def lip(k: KernelProc, program, *args: str, stdin=()):
    """Run userland/<program> (or a LIP file) through the client library (what
    `symphony run` does, without starting a CLI process): (status, stdout, stderr)."""
    out, err = [], []
    path = REPO / "userland" / program
    with k.client() as c:
        pid = c.spawn(path.read_text(), args, filename=path.name)
        for line in stdin:
            c.send_input(pid, line)
        c.send_input(pid, None)                              # end of input: recv() returns None
        for ev in c.events(timeout=120):
            if ev["event"] in ("out", "stdout"):
                out.append(ev["data"] if isinstance(ev["data"], str) else json.dumps(ev["data"]) + "\n")
            elif ev["event"] == "stderr":
                err.append(ev["data"])
    return ev["status"], "".join(out), "".join(err)


def engine_greedy(engine, prompt, n):
    tok, seq, ids = engine.tokenizer, engine.new_sequence(), []
    logits = engine.pred(seq, tok.encode(prompt))
    for _ in range(n):
        t = int(logits.argmax())
        if t in tok.eos_ids:
            break
        ids.append(t)
        logits = engine.pred(seq, [t])
    engine.release(seq)
    return tok.decode(ids, skip_special=True)


@cpu_kernel_only
def test_complete_greedy_matches_engine_and_stops(kernel, smollm):
    want = engine_greedy(smollm, PROMPT, 16)
    r = kernel.run(REPO / "userland/complete.py", PROMPT, "--max-tokens", "16", "--temperature", "0")
    assert r.returncode == 0, r.stderr                   # (the real `symphony run`, once)
    assert r.stdout == want + "\n" and len(want) > 30
    stop = want[12:18]                                   # some characters in the middle
    status, out, err = lip(kernel, "complete.py", PROMPT, "--max-tokens", "16", "--temperature", "0",
                           "--stop", "@@@", "--stop", stop)
    assert status == 0, err
    assert out == want[:want.index(stop)] + "\n"
    status, out, err = lip(kernel, "complete.py", PROMPT, "--top-p", "1.5")
    assert status == 2 and "top_p must be in" in err and "usage: complete.py" in err


def test_complete_seeded_sampling(kernel):
    run = lambda seed: lip(kernel, "complete.py", PROMPT, "--max-tokens", "16", "--top-k", "40", "--min-p",
                           "0.02", "--repetition-penalty", "1.1", "--seed", str(seed))
    a, b, c = run(1), run(1), run(2)
    assert a[0] == 0 and a[1].strip(), a
    assert a == b and a != c


def test_chat_answers_and_keeps_the_kv_file(kernel):
    status, out, err = lip(kernel, "chat.py", "What is the capital of France?", "--max-tokens", "24", "-v",
                           stdin=["", "And what is the capital of Italy?"])
    assert status == 0, err
    answers = out.strip().split("\n")
    assert len(answers) == 2 and "Paris" in answers[0] and answers[1].strip(), out
    turns = [list(map(int, re.findall(r"\d+", line))) for line in err.splitlines() if line.startswith("[chat")]
    (pre1, kv1), (pre2, kv2) = turns                         # (prefilled, KV length) per turn
    assert pre2 < 30 < pre1 < kv1 < kv2                      # turn 2 prefilled only the new turn
    done = [l for l in kernel.client().ps()["finished"] if l["file"] == "chat.py"][-1]
    assert done["tokens"] <= kv2 + 4                         # each KV token computed once (recomputing: > kv1 + kv2)


# ---------------------------------------------------------------- beam search on a tiny model
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random model (vocab 262) whose next-token distributions are peaked
    enough (output weights x3) that two-token sequences outscore EOS and the
    greedy first token is not always the best one; in-process and in a kernel."""
    from modelfiles import hf_state_dict, tiny_hf_config, write_gguf
    from symphony.engine.config import EngineConfig
    from symphony.engine.engine import Engine
    tmp = tmp_path_factory.mktemp("tiny")
    cfg = tiny_hf_config()
    sd = hf_state_dict(cfg, seed=3)
    sd["lm_head.weight"] *= 3
    path = write_gguf(tmp / "tiny.gguf", cfg, sd)
    engine = Engine.load(path, EngineConfig(page_size=16, num_pages=4096), progress=False)
    k = KernelProc(tmp, "--model", str(path))
    yield engine, k
    k.stop()


def two_token_table(engine, prompt):
    """Exact log-probs of every 2-token continuation: lp1 [V], lp2 [V, V]."""
    from symphony.engine.engine import PredRequest
    seq = engine.new_sequence()
    lp1 = log_softmax(np.asarray(engine.pred(seq, engine.tokenizer.encode(prompt))))
    forks = [engine.fork(seq) for _ in range(lp1.size)]
    lp2 = log_softmax(np.stack([np.asarray(x) for x in
                                engine.pred_batch([PredRequest(f, [t]) for t, f in enumerate(forks)])]))
    for f in forks + [seq]:
        engine.release(f)
    return lp1, lp2


def predicted(lp1, lp2, eos, beams, alpha=0.0):
    """What beam search with `beams` beams over 2 tokens must return: the best of
    [EOS] (if among the top first tokens) and every (t1, t2) with t1 a surviving
    first token (a B-beam search keeps the top-B first tokens, then the best
    second step of them is among the top-B candidates)."""
    first = np.argsort(-lp1, kind="stable")[:beams]
    hyps = [((int(t),), lp1[t]) for t in first if t == eos]
    hyps += [((int(t), int(lp2[t].argmax())), lp1[t] + lp2[t].max()) for t in first if t != eos]
    return max(hyps, key=lambda h: h[1] / len(h[0]) ** alpha)


@cpu_kernel_only
def test_beam_search_is_exact_where_it_must_be(tiny_model):
    engine, k = tiny_model
    eos = engine.tokenizer.eos_id
    for prompt in ("the", "hello there", "he said", "a b c", "then", "tea"):
        lp1, lp2 = two_token_table(engine, prompt)
        best = predicted(lp1, lp2, eos, lp1.size)
        rank = list(np.argsort(-lp1, kind="stable")).index(best[0][0])
        if rank >= 2:                                    # the best first token is only the 3rd+
            break
    assert rank >= 2, "no prompt where beam width matters"
    for beams, alpha in ((rank, 0.0), (rank + 1, 0.0), (lp1.size, 0.0), (rank + 1, 1.0)):
        status, out, err = lip(k, "beam.py", prompt, "--beams", str(beams), "--max-tokens", "2",
                               "--length-penalty", str(alpha))
        assert status == 0, err
        got = json.loads(out)
        seq = tuple(got["tokens"]) + ((eos,) if got["eos"] else ())
        true_lp = lp1[seq[0]] + (lp2[seq[0], seq[1]] if len(seq) > 1 else 0)
        want = predicted(lp1, lp2, eos, beams, alpha)
        assert got["logprob"] == pytest.approx(true_lp, abs=1e-3)          # scores are the real ones
        assert got["score"] == pytest.approx(true_lp / len(seq) ** alpha, abs=1e-3)
        assert got["score"] == pytest.approx(want[1] / len(want[0]) ** alpha, abs=1e-3), (beams, alpha)
        if alpha == 0:
            assert got["logprob"] <= best[1] + 1e-3      # never better than brute force
        if beams <= rank:
            assert got["logprob"] < best[1] - 1e-3       # too narrow: misses the best sequence
        if beams == lp1.size and alpha == 0:
            assert seq == best[0]                        # full width = brute force


FORK_JOIN_LIP = """
from symphony.lip import kv, pred, send, tokenize
from symphony.lip.helpers import fork_join, generate

def main(prompt):
    with kv.create() as base:
        pred(base, tokenize(prompt))
        out = fork_join(base, lambda f, t: (len(f), generate(f, [t], 4)[1]), [10, 200, 30, 77, 5])
        send({"out": out, "base": len(base)})
"""


def test_fork_join_and_generate_on_forks(tiny_model, tmp_path):
    engine, k = tiny_model
    (tmp_path / "fj.py").write_text(FORK_JOIN_LIP)
    status, out, err = lip(k, tmp_path / "fj.py", "he said")
    assert status == 0, err
    got, prompt = json.loads(out), engine.tokenizer.encode("he said")
    assert got["base"] == len(prompt)                       # the forks left the prefix alone
    for t, (start, ids) in zip([10, 200, 30, 77, 5], got["out"]):      # results in item order
        seq, want = engine.new_sequence(), []
        logits = engine.pred(seq, prompt + [t])
        while len(want) < 4 and int(logits.argmax()) != engine.tokenizer.eos_id:
            want.append(int(logits.argmax()))
            logits = engine.pred(seq, want[-1:])
        engine.release(seq)
        assert start == len(prompt) and ids == want
