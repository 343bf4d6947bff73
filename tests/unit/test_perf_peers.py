"""perf/peers.py and the benchmarks that use it (perf/bench_gateway.py, perf/bench_decode.py),
without the peers installed: the command lines are checked, a peer that is not installed is
skipped with its reason (nothing started, nothing silent), and a started peer's processes are
paused, resumed and all stopped. The started "peer" is a stand-in executable named by
$LLAMA_SERVER (a small HTTP server with a child process), so the lifecycle is exercised on real
processes without building llama.cpp."""
from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "perf"))

import bench_decode  # noqa: E402
import bench_gateway  # noqa: E402
import peers  # noqa: E402

STAND_IN = textwrap.dedent('''\
    #!{python}
    """A stand-in for llama-server: --version, or serve /health on --port (MODE: ok, sigill, mute)."""
    import http.server, os, signal, subprocess, sys, time
    if "--version" in sys.argv:
        print("version: 4242 (stand-in)")
        sys.exit(0)
    mode = os.environ.get("STAND_IN_MODE", "ok")
    if mode == "sigill":
        os.kill(os.getpid(), signal.SIGILL)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["STAND_IN_PIDS"], "w") as f:
        f.write(f"{{os.getpid()}} {{child.pid}}")
    if mode == "mute":
        time.sleep(600)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            busy = os.environ.get("STAND_IN_BUSY")
            if self.path == "/metrics" and busy:
                self.send_response(200)
                self.end_headers()
                n = open(busy).read().strip() or "0"
                self.wfile.write(f"llamacpp:requests_processing {{n}}\\n".encode())
                return
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b'{{"status": "ok"}}')
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def no_peers(tmp_path, monkeypatch):
    """An empty peers directory, no $LLAMA_SERVER, no llama-server on PATH."""
    monkeypatch.setenv("SYMPHONY_PEERS_DIR", str(tmp_path / "peers"))
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    return tmp_path / "peers"


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    exe = tmp_path / "llama-server"
    exe.write_text(STAND_IN.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setenv("LLAMA_SERVER", str(exe))
    monkeypatch.setenv("STAND_IN_PIDS", str(tmp_path / "pids"))
    return tmp_path / "pids"


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    return s[s.rindex(")") + 2]


def test_a_peer_not_installed_says_why_and_where(no_peers):
    for name in peers.NAMES + peers.EXTRAS:
        why = peers.available(name)
        assert "not installed" in why and str(no_peers) in why and "$SYMPHONY_PEERS_DIR" in why, why
        assert f"python perf/peers.py install {name}" in why
        with pytest.raises(peers.Unavailable, match="not installed"):
            with peers.peer(name, slots=2):
                pytest.fail("a peer that is not installed started")
    with pytest.raises(ValueError, match="unknown peer"):
        peers.available("tgi")
    with pytest.raises(ValueError, match="slots"):
        with peers.peer("llama-server", slots=0):
            pass


def test_a_started_peer_is_paused_resumed_and_stopped_with_its_children(stand_in, tmp_path):
    with peers.peer("llama-server", slots=3, log_dir=tmp_path / "logs") as p:
        server, child = (int(x) for x in stand_in.read_text().split())
        assert set(p.pids()) >= {server, child}
        assert "-np 3" in " ".join(p.argv) and "--cache-reuse" in p.argv and p.model == "smollm2"
        assert "version: 4242" not in p.describe() and "4242" in p.version
        with urllib.request.urlopen(p.url + "/health", timeout=10) as r:
            assert r.status == 200
        p.pause()
        assert {_state(server), _state(child)} == {"T"}
        p.resume()
        assert _state(server) != "T" and _state(child) != "T"
        assert p.cpu_seconds() >= 0 and p.startup_s is not None
    deadline = time.time() + 10
    while time.time() < deadline and (_state(server) not in (None, "Z") or _state(child) not in (None, "Z")):
        time.sleep(0.1)
    assert _state(server) in (None, "Z") and _state(child) in (None, "Z")


def test_a_peer_is_paused_only_once_it_reports_no_request_in_flight(stand_in, tmp_path, monkeypatch):
    import threading
    busy = tmp_path / "busy"
    busy.write_text("2")
    monkeypatch.setenv("STAND_IN_BUSY", str(busy))
    with peers.peer("llama-server", slots=2, log_dir=tmp_path / "logs") as p:
        server, _ = (int(x) for x in stand_in.read_text().split())
        assert p.busy() == 2
        t = threading.Thread(target=p.pause)
        t.start()
        time.sleep(0.6)
        assert t.is_alive() and _state(server) != "T"          # requests in flight: not stopped
        busy.write_text("0")
        t.join(10)
        assert not t.is_alive() and _state(server) == "T"
        p.resume()


def test_a_peer_that_dies_or_never_answers_is_unavailable_and_gone(stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_MODE", "sigill")
    with pytest.raises(peers.Unavailable, match="SIGILL"):
        with peers.peer("llama-server", slots=1, log_dir=tmp_path / "logs"):
            pass
    monkeypatch.setenv("STAND_IN_MODE", "mute")
    t0 = time.time()
    with pytest.raises(peers.Unavailable, match="did not answer /health within 3 s"):
        with peers.peer("llama-server", slots=1, start_timeout=3, log_dir=tmp_path / "logs"):
            pass
    assert time.time() - t0 < 60
    server, child = (int(x) for x in stand_in.read_text().split())
    assert _state(server) in (None, "Z") and _state(child) in (None, "Z")


def test_box_load_names_our_processes_and_the_others():
    load = peers.BoxLoad({"me": [os.getpid()]})
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    used = load.stop()
    assert used["cores"] == os.cpu_count() and used["seconds"] > 0
    assert used["me_cores"] > 0.3 and used["others_cores"] >= 0 and used["cores_busy"] >= used["others_cores"]


@pytest.mark.parametrize("argv, message", [
    (["--peers", "tgi"], "--peers: unknown 'tgi'"),
    (["--extras", "ollama"], "--extras: unknown 'ollama'"),
    (["--workloads", "warm,hot"], "--workloads: unknown 'hot'"),
    (["--ours", "int4"], "--ours: unknown 'int4'"),
    (["--only", "d"], "--only: unknown 'd'"),
    (["--clients", "1,0"], "must be >= 1"),
    (["--clients", "many"], "comma-separated numbers"),
    (["--rounds", "0"], "must be >= 1"),
    (["--only", "b", "--ours", "", "--peers", "none"], "needs a contender"),
])
def test_bench_gateway_rejects_a_bad_command_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_gateway.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_gateway_command_line():
    a = bench_gateway.parse_args([])
    assert a.levels == [1, 4, 16, 64] and a.peer_names == ["llama-server", "vllm"]
    assert a.workloads == ["warm", "cold", "plain"] and a.ours == ["quantized"] and a.only == {"a", "b", "c"}
    a = bench_gateway.parse_args(["--peers", "vllm", "--extras", "llama-cpp-python", "--clients", "16"])
    assert a.peer_names == ["vllm", "llama-cpp-python"] and a.levels == [16]
    assert bench_gateway.parse_args(["--no-llamacpp"]).peer_names == []


def test_bench_gateway_skips_the_peers_not_installed_with_the_reason(no_peers, tmp_path, capsys):
    a = bench_gateway.parse_args(["--clients", "1,4"])
    ours = [bench_gateway.Contender("symphony", "http://127.0.0.1:1", "m", {}, lambda: [])]
    field = bench_gateway.Field(a, tmp_path, ours)
    try:
        field.enter_level(4)
        assert field.contenders() == ours
    finally:
        field.close()
    assert set(field.skipped) == {"llama-server", "vllm"}
    out = capsys.readouterr().out
    for name, why in field.skipped.items():
        assert "not installed" in why and f"# {name}: skipped: {why}" in out


def test_bench_gateway_with_every_contender_skipped_measures_nothing(no_peers, tmp_path, capsys):
    a = bench_gateway.parse_args(["--clients", "1,4", "--ours", "", "--only", "b"])
    field = bench_gateway.Field(a, tmp_path, [])
    results = {"rows": {}}
    try:
        bench_gateway.bench_b(field, a, results)
    finally:
        field.close()
    assert results["rows"] == {}
    out = capsys.readouterr().out
    assert "(b) 1 clients: no contender to measure" in out and "(b) 4 clients: no contender" in out


@pytest.mark.parametrize("argv, message", [
    (["--servers", "tgi"], "--servers: unknown 'tgi'"),
    (["--server-batches", "1,0"], "numbers >= 1"),
    (["--server-batches", "x"], "numbers >= 1"),
    (["--dtypes", "int3"], "unknown dtype 'int3'"),
    (["--servers-only", "--servers", "none"], "--servers-only needs"),
    (["--servers-only", "--model", "x.gguf"], "--servers-only needs"),
    (["--steps", "1"], "--steps must be >= 2"),
])
def test_bench_decode_rejects_a_bad_command_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_decode.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_decode_skips_the_servers_not_installed_with_the_reason(no_peers, capsys):
    args = bench_decode.parse_args(["--servers-only", "--servers", "llama-server,vllm", "--rounds", "1",
                                    "--steps", "4", "--server-batches", "1,2"])
    assert args.server_names == ["llama-server", "vllm"] and args.batches == [1, 2]
    out = bench_decode.bench_servers(args)
    assert set(out["skipped"]) == {"llama-server", "vllm"} and out["servers"] == {} and out["rounds"] == {}
    printed = capsys.readouterr().out
    for name, why in out["skipped"].items():
        assert "not installed" in why and f"# {name}: skipped: {why}" in printed


def test_prometheus_counters_are_summed_over_labels_without_buckets():
    text = textwrap.dedent("""\
        # TYPE llamacpp:n_decode_total counter
        llamacpp:n_decode_total 12
        # TYPE vllm:iteration_tokens_total histogram
        vllm:iteration_tokens_total_bucket{le="1.0",model_name="m"} 3
        vllm:iteration_tokens_total_bucket{le="+Inf",model_name="m"} 5
        vllm:iteration_tokens_total_sum{model_name="m"} 100
        vllm:iteration_tokens_total_count{model_name="m"} 5
        # TYPE vllm:prompt_tokens counter
        vllm:prompt_tokens_total{engine="0"} 2
        vllm:prompt_tokens_total{engine="1"} 3
        """)
    assert peers.parse_metrics(text) == {"llamacpp:n_decode_total": 12, "vllm:iteration_tokens_total_sum": 100,
                                         "vllm:iteration_tokens_total_count": 5, "vllm:prompt_tokens_total": 5}


def test_what_each_server_computed_in_a_round_from_its_counters():
    sym = bench_gateway.work({"forward_passes": 10, "pred_calls": 10, "tokens_computed": 100, "host_handle_s": 1.0},
                             {"forward_passes": 30, "pred_calls": 90, "tokens_computed": 300, "host_handle_s": 1.5}, 2.0)
    assert (sym["steps"], sym["seqs_per_step"], sym["tokens_per_step"], sym["steps_per_s"]) == (20, 4.0, 10.0, 10.0)
    assert sym["syscall_thread_s"] == 0.5 and sym["counters"]["pred_calls"] == 80
    ls = bench_gateway.work({"llamacpp:n_decode_total": 10, "llamacpp:n_busy_slots_per_decode": 1.0,
                             "llamacpp:prompt_tokens_total": 50, "llamacpp:tokens_predicted_total": 10},
                            {"llamacpp:n_decode_total": 30, "llamacpp:n_busy_slots_per_decode": 3.0,
                             "llamacpp:prompt_tokens_total": 150, "llamacpp:tokens_predicted_total": 70}, 4.0)
    assert (ls["steps"], ls["seqs_per_step"], ls["prompt_computed"], ls["tokens"]) == (20, 4.0, 100, 160)
    vl = bench_gateway.work({"vllm:iteration_tokens_total_count": 5, "vllm:iteration_tokens_total_sum": 50,
                             "vllm:prompt_tokens_total": 40, "vllm:prefix_cache_hits_total": 0},
                            {"vllm:iteration_tokens_total_count": 15, "vllm:iteration_tokens_total_sum": 250,
                             "vllm:prompt_tokens_total": 240, "vllm:prefix_cache_hits_total": 128}, 5.0)
    assert (vl["steps"], vl["tokens_per_step"], vl["prompt_computed"], vl["steps_per_s"]) == (10, 20.0, 72, 2.0)
    assert bench_gateway.work({}, {"error": "no stats"}, 1.0) == {"counters": {}}
