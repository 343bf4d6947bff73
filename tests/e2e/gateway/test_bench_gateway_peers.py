"""perf/bench_gateway.py end to end at the smallest size, on a machine without the peers: it
starts a real kernel with --http, says why each peer is skipped, measures Symphony alone and
writes the figures it printed to --json. (The peers' side is covered without them in
tests/unit/test_perf_peers.py; the comparison itself is a benchmark, not a test.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO


def test_bench_gateway_runs_symphony_alone_and_names_the_skipped_peers(tmp_path):
    out = tmp_path / "b.json"
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)   # no llama-server on it
                           if d and not os.path.exists(os.path.join(d, "llama-server")))
    env = dict(os.environ, SYMPHONY_PEERS_DIR=str(tmp_path / "no-peers"), PATH=path, PYTHONPATH=str(REPO))
    env.pop("LLAMA_SERVER", None)
    r = subprocess.run([sys.executable, str(REPO / "perf" / "bench_gateway.py"), "--only", "b", "--clients", "2",
                        "--rounds", "1", "--turns", "1", "--max-tokens", "2", "--workloads", "plain",
                        "--plain-tokens", "40", "--kv-memory-mb", "256", "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ("llama-server", "vllm"):
        assert f"# {name}: skipped: " in r.stdout and "not installed" in r.stdout
    assert "(b) plain, 2 clients" in r.stdout and "symphony" in r.stdout
    res = json.loads(out.read_text())
    assert set(res["skipped"]) == {"llama-server", "vllm"}
    assert res["machine"]["cpu"] and res["machine"]["cores"] == os.cpu_count() and res["machine"]["load_after"]
    [rnd] = res["rows"]["plain/2"]["rounds"]["symphony"]
    assert rnd["failures"] == 0 and rnd["requests"] == 2 and rnd["tok_s"] > 0
    assert 0 < rnd["ttft_p50"] <= rnd["ttft_p99"] and rnd["out_tokens_per_request"] == 2
    assert rnd["prompt_tokens"] > 2 * 40 and rnd["others_cores"] >= 0
    assert res["contenders"]["symphony"]["argv"][1:3] == ["-m", "symphony.kernel"]
