"""perf/paper/rag_skew.py without a kernel: the popularity draw, the queries, the facts
asked about, and the tables and plot recomputed from a raw data file (--report)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "perf" / "paper"))
sys.path.insert(0, str(REPO / "perf"))

import rag_skew  # noqa: E402
from bench_rag import make_docs  # noqa: E402


def test_the_draw_is_uniform_at_zero_one_document_at_one_and_skewed_between():
    order = rag_skew.ranks(50)
    assert set(rag_skew.draw_zipf(50, 300, "one", 1, order)) == {order[0]}
    uniform = rag_skew.draw_zipf(50, 5000, 0.0, 1, order)
    assert max(uniform.count(d) for d in range(50)) < 3 * 5000 / 50
    skewed = rag_skew.draw_zipf(50, 5000, 1.43, 1, order)
    assert skewed.count(order[0]) > skewed.count(order[10]) > 0
    assert rag_skew.draw(50, 200, float("inf"), 3) == rag_skew.draw_zipf(50, 200, 0.0, 3)


def test_queries_hold_k_distinct_documents_the_asked_one_first_the_rest_by_rank():
    order = rag_skew.ranks(30)
    rank = {d: r for r, d in enumerate(order)}
    qs = rag_skew.queries(30, 200, 1.13, 3, 5, order)
    assert qs == rag_skew.queries(30, 200, 1.13, 3, 5, order)          # seeded
    for q in qs:
        assert len(q) == len(set(q)) == 3
        assert [rank[d] for d in q[1:]] == sorted(rank[d] for d in q[1:])
    assert all(len(set(q)) == 3 for q in rag_skew.queries(30, 20, "one", 3, 5, order))


def test_every_generated_document_has_a_fact_to_ask_about():
    for _, text in make_docs(200, 12).values():
        question, number = rag_skew.fact(text)
        assert question.startswith("How many ") and number in text and number.isdigit()


def _row(contender, answers, wall=10.0, error=None):
    recs = [{"ttft": 1.0, "latency": 1.0 + i, "prompt": 100, "reused": 0 if contender == "recompute" else 50,
             "computed": 100 if contender == "recompute" else 50, "answer": a, "error": error}
            for i, a in enumerate(answers)]
    return {"skew": 1.13, "round": 0, "contender": contender, "wall_s": wall, "box": {}, "load_before": [1, 1, 1],
            "load_after": [1, 1, 1], "queries": [[0]] * len(answers), "records": recs, "truth": ["12", "34"]}


def test_report_recomputes_the_tables_from_the_raw_queries(tmp_path):
    data = {"meta": {"commit": "0" * 40, "cpu": "test CPU", "cores": 2, "date": "2026-11-29", "command": "x",
                     "args": {"k": 1, "docs": 2, "kv_tokens": 1000, "concurrency": 1}},
            "rows": [_row("recompute", ["12 owls", "34 keys"]), _row("lru", ["12 owls", "no idea"], wall=5.0,
                                                                      error=None)]}
    path = tmp_path / "raw.json"
    path.write_text(json.dumps(data))
    out = subprocess.run([sys.executable, str(REPO / "perf/paper/rag_skew.py"), "--report", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lru = next(line for line in out.stdout.splitlines() if line.startswith("| 1.13 | lru |"))
    cells = [c.strip() for c in lru.strip("|").split("|")]
    assert cells[2].startswith("0.40") and cells[3].startswith("2.00")          # q/s, x recompute
    assert cells[6].startswith("50") and cells[7].startswith("0.500")           # computed, hit
    assert cells[8].startswith("0.50") and cells[9].startswith("0.50")          # correct, same answers


def test_the_plot_is_drawn_from_the_raw_queries(tmp_path):
    pytest.importorskip("matplotlib")
    data = {"meta": {"commit": "0" * 40, "cpu": "test CPU", "cores": 2, "date": "2026-11-29", "command": "x",
                     "args": {"k": 1, "docs": 2, "kv_tokens": 1000, "concurrency": 1}},
            "rows": [_row("recompute", ["12", "34"]), dict(_row("app", ["12", "34"]), skew=0.0),
                     dict(_row("recompute", ["12", "34"]), skew=0.0)]}
    path, png = tmp_path / "raw.json", tmp_path / "rag.png"
    path.write_text(json.dumps(data))
    assert rag_skew.report_file(path, str(png)) == 0
    assert png.stat().st_size > 10_000
