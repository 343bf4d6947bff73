"""perf/paper/apps.py without a kernel: the answer check, the client's forced choice with
logit_bias against a fake server, and the tables and plot recomputed from a raw data file."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "perf" / "paper"))
sys.path.insert(0, str(REPO / "perf"))

import apps  # noqa: E402
from modelfiles import tiny_tokenizer  # noqa: E402


def test_an_answer_is_right_when_the_number_asked_for_is_in_it():
    assert apps.correct("The answer is 3,367.", 3367) and apps.correct("11.0", 11)
    assert apps.correct("64 / 8 + 3 = 11", 11) and apps.correct("3367\n\nSo 3367 it is", 3367)
    assert not apps.correct("about 3366", 3367) and not apps.correct("", 8)
    assert not apps.correct("36 + 36 = 72 cows.", 36)                    # the answer is its last number
    assert apps.correct("anything", None) is None
    assert apps.expected("completion", 3) is None
    assert apps.expected("react", 1) == apps.QUESTIONS[1][1] and apps.expected("got-exact", 1) == apps.PROBLEMS[1][1]


class FakeHTTP:
    """A /v1/completions server that obeys logit_bias: the largest biased token id, as text."""

    def __init__(self, tok):
        self.tok, self.bodies = tok, []

    def post(self, url, json):
        self.bodies.append(json)
        bias = json.get("logit_bias") or {}
        text = self.tok.decode([max(int(t) for t in bias)]) if bias else "free text"
        return type("R", (), {"status_code": 200, "json": lambda s: {
            "choices": [{"text": text}], "usage": {"completion_tokens": 1}}})()


def test_a_forced_choice_is_one_request_a_branching_point_with_the_allowed_tokens_biased():
    tok = tiny_tokenizer()
    http = FakeHTTP(tok)
    r = apps.Remote(http, "http://x", "m", tok, "so far ")
    options = ["transfer to ab", "transfer to cd", "answer:"]
    pick = r.choose(options)
    assert pick in options and r.text == "so far " + pick
    seqs, path = [tok.encode(o) for o in options], tok.encode(pick)
    branching = [i for i in range(len(path)) if len({s[i] for s in seqs if s[:i] == path[:i]}) > 1]
    assert len(http.bodies) == len(branching) == r.generated
    for i, body in zip(branching, http.bodies):
        assert body["max_tokens"] == 1 and body["temperature"] == 0
        assert set(body["logit_bias"]) == {str(s[i]) for s in seqs if s[:i] == path[:i]}
        assert set(body["logit_bias"].values()) == {100}


def _point(pps, correct):
    """A point of one ReAct program (question 0: 3367), its answer right or wrong."""
    return {"pps": pps, "wall": 10.0, "p50": 1.0, "p99": 2.0, "generated": 30.0, "correct": None, "failed": 0,
            "programs": [{"i": 0, "latency": 1.0, "generated": 30, "answer": "3367" if correct else "12",
                          "correct": not correct}]}          # the verdict is recomputed from the answer


def test_report_recomputes_the_tables_and_the_plot(tmp_path):
    data = {"setup": ["# test"], "apps": ["react"], "concs": [1, 4], "contenders": ["lip", "gateway"], "many": False,
            "res": {"react": {"lip": {"1": [_point(2.0, True), _point(4.0, True)], "4": [_point(3.0, False)] * 2},
                              "gateway": {"1": [_point(1.0, True), _point(1.0, False)], "4": [_point(3.0, True)] * 2}}}}
    path, png = tmp_path / "raw.json", tmp_path / "apps.png"
    path.write_text(json.dumps(data))
    args = [sys.executable, str(REPO / "perf/paper/apps.py"), "--report", str(path)]
    if pytest.importorskip("matplotlib"):
        args += ["--plot", str(png)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("| react | 1 | 3.000"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "3.000 (2.000..4.000)" and cells[3] == "1.000 (1.000..1.000)"
    assert cells[4] == "3.00 (2.00..4.00)"                                     # lip / gateway per round
    right = next(line for line in out.stdout.splitlines() if line.startswith("| react | 1 | 30.0"))
    assert "| 2/2 | 1/2 |" in right
    assert png.stat().st_size > 10_000
