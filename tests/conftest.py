import pytest
import torch

from symphony.engine.config import EngineConfig, ModelConfig
from symphony.engine.weights import random_weights

# Tolerances, stated once (float32 on the CPU):
#   tiny random models: paged logits vs reference, max |diff| <= 1e-4
#   SmolLM2-135M (logits of magnitude ~20): max |diff| <= 2e-3 on float activations; 2e-2 where
#   the engine's default kernels round x to 15 bits (CPUs with AVX-512 VNNI: below 64 rows a
#   call, csrc/cpu/qlinear.cpp): measured up to 1.03e-2 against the float32 reference over the
#   30 layers (1 / 2000 of the logits' scale; int8 activations move them by 1 / 27)
TINY_ATOL = 1e-4
_FLAGS = set(open("/proc/cpuinfo").read().split())
# ... and on AVX2 CPUs without AVX-512 (paths 12 and 11, below 32 rows)
SMOLLM_ATOL = 2e-2 if "avx512_vnni" in _FLAGS or ({"avx2", "fma"} <= _FLAGS and "avx512f" not in _FLAGS) else 2e-3

# Reduced precision on the CPU (weights, activations and KV pool in the dtype; final norm and
# logits from a float32 head).  Tiny random models have logits of magnitude ~1.5; the bfloat16
# ulp there is 2^-7 = 0.0078, the float16 one 2^-10 = 0.001.  Max |diff| of engine logits
# measured over 5 configs x 3 seeds, 40-token prefill+decode runs:
#                                    bfloat16           float16
#   vs ReferenceLlama in float32     <= 0.0078 (tol .02)  <= 0.0010 (tol .003)
#   vs ReferenceLlama in the dtype   <= 0.0036 (tol .01)  <= 0.0005 (tol .0015)
# SmolLM2 (max |logit| ~ 30): see test_smollm2.py.
HALF_TINY_ATOL = {torch.bfloat16: 0.02, torch.float16: 0.003}
HALF_TINY_SAME_DTYPE_ATOL = {torch.bfloat16: 0.01, torch.float16: 0.0015}


def tiny_config(**over) -> ModelConfig:
    base = dict(arch="llama", vocab_size=101, hidden_size=64, intermediate_size=96, n_layers=2,
                n_heads=4, n_kv_heads=2, head_dim=16, max_context=256, name="tiny")
    base.update(over)
    return ModelConfig(**base)


@pytest.fixture
def tiny_weights():
    return random_weights(tiny_config(), seed=0)


@pytest.fixture(scope="session")
def smollm():
    """The real embedded model, loaded once per test session."""
    from symphony.engine.engine import Engine
    return Engine.load(config=EngineConfig(page_size=16, num_pages=1024), progress=False)


@pytest.fixture(scope="session")
def smollm_reference(smollm):
    from symphony.engine.reference import ReferenceLlama
    return ReferenceLlama(smollm.model.w)     # the same weights, shared, not reloaded


# ---------------------------------------------------------------- a real kernel
import contextlib
import http.server
import os
import shlex
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]

IS_ROOT = os.geteuid() == 0
requires_root = pytest.mark.skipif(
    not IS_ROOT, reason="needs root: the kernel must run as root to give each LIP its own uid and "
                        "to let tests connect as other Unix users")

class QuietHandler(http.server.BaseHTTPRequestHandler):
    """Base of the tests' local HTTP handlers: no access log; `redirect` and `reply`."""

    def redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.end_headers()

    def reply(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@contextlib.contextmanager
def http_servers(handler, n: int = 2):
    """``n`` local threading HTTP servers running ``handler``; yields their ports."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(n)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        yield [s.server_address[1] for s in servers]
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


# Two ordinary Unix users for multi-user tests (no passwd entries needed: the kernel
# names a uid without one "uid<N>").
ALICE_UID, BOB_UID = 2101, 2102


def connect_as(socket_path: str, uid: int, gid: Optional[int] = None):
    """A Unix socket connected to the kernel by a process running as ``uid``.

    The kernel identifies a client by the credentials of the process that called
    connect() (SO_PEERCRED), so a forked child drops to ``uid`` (needs root), connects,
    and hands the connected socket back over SCM_RIGHTS; the caller then speaks as that
    user.  The socket's directory must be searchable by ``uid``."""
    import socket as _socket
    a, b = _socket.socketpair()
    pid = os.fork()
    if pid == 0:                                    # child: only plain system calls, then _exit
        code = 1
        try:
            os.setgroups([])
            os.setgid(gid if gid is not None else uid)
            os.setuid(uid)
            s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            s.connect(socket_path)
            _socket.send_fds(b, [b"s"], [s.fileno()])
            code = 0
        finally:
            os._exit(code)
    b.close()
    try:
        _, fds, _, _ = _socket.recv_fds(a, 1, 1)
    finally:
        a.close()
        _, status = os.waitpid(pid, 0)
    if not fds:
        raise RuntimeError(f"could not connect to {socket_path} as uid {uid} (child status {status})")
    return _socket.socket(fileno=fds[0])


# Flags every test kernel gets, before the test's own (which win): e.g.
# SYMPHONY_TEST_KERNEL_ARGS="--gpus 0" runs the kernel tests' LIPs on a GPU.
_EXTRA_KERNEL_ARGS = shlex.split(os.environ.get("SYMPHONY_TEST_KERNEL_ARGS", ""))


def _kernel_device(args) -> str:
    """The device a test kernel's engine runs on under those flags ("cpu" or "cuda:N")."""
    for i, a in enumerate(args):
        value = args[i + 1] if a == "--gpus" and i + 1 < len(args) else (
            a.split("=", 1)[1] if a.startswith("--gpus=") else None)
        if value is not None:
            return f"cuda:{value.split(',')[0]}"
    return "cpu"


KERNEL_DEVICE = _kernel_device(_EXTRA_KERNEL_ARGS)
# For tests that compare a test kernel with the in-process CPU engine token for token (or to
# 1e-3 in log-probabilities), or count its CPU threads: not meaningful on a GPU kernel.
cpu_kernel_only = pytest.mark.skipif(
    KERNEL_DEVICE != "cpu", reason="compares the test kernel with the in-process CPU engine; "
                                   "SYMPHONY_TEST_KERNEL_ARGS puts it on " + KERNEL_DEVICE)


class KernelProc:
    """symphony-kernel running in a subprocess on its own socket."""

    def __init__(self, tmp: Path, *extra: str, nofile: Optional[int] = None, session: bool = False,
                 env: Optional[dict] = None):
        """``nofile``: the kernel's open-file limit (soft and hard), when a test needs it low;
        ``session``: start it in a session of its own, as a service runs (then the test's own
        threads, acting as other users' clients, are not in its CPU scheduling group);
        ``env``: variables set in its environment besides the test's own."""
        # the socket lives in a directory every user may search (tests connect as other uids)
        self.sock_dir = tempfile.mkdtemp(prefix="symphony-test-", dir="/tmp")
        os.chmod(self.sock_dir, 0o755)
        self.socket = os.path.join(self.sock_dir, "kernel.sock")
        self.log = open(tmp / "kernel.log", "w+")
        self.env = dict(os.environ, **(env or {}), SYMPHONY_SOCKET=self.socket, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from symphony.cli import kernel_main; sys.exit(kernel_main())",
             "--socket", self.socket, "--kv-memory-mb", "192", *_EXTRA_KERNEL_ARGS, *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO, start_new_session=session,
            preexec_fn=None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                                               (nofile, nofile)))
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("kernel died at start:\n" + self.read_log())
            if "ready on" in self.read_log():
                break
            time.sleep(0.2)
        else:
            raise RuntimeError("kernel did not start:\n" + self.read_log())
        from symphony.engine.hostmem import commit_ended
        args = [*_EXTRA_KERNEL_ARGS, *extra]
        if "lazy" not in args and not any(a.startswith("--gpus") for a in args):
            # a host KV pool is committed in the background once the kernel serves: wait for it,
            # so that what a test measures of the kernel's memory or time does not include it
            settle = time.time() + 60
            while time.time() < settle and not commit_ended(self.read_log()):
                if self.proc.poll() is not None:
                    raise RuntimeError("kernel died at start:\n" + self.read_log())
                time.sleep(0.05)
        self.instance = self.client().stats()["instance"]

    def read_log(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def client(self, user=None, timeout: float = 30):
        from symphony.client import Client
        return Client(self.socket, user=user, timeout=timeout)

    def client_as(self, uid: int, timeout: float = 30):
        """A client connected by a process of Unix user ``uid`` (needs root)."""
        from symphony.client import Client
        return Client(self.socket, timeout=timeout, sock=connect_as(self.socket, uid))

    def run(self, lip: str, *args: str, user=None, timeout=120, stdin=None, extra=()):
        """`symphony run` as a user would type it; returns CompletedProcess."""
        cmd = [sys.executable, "-m", "symphony.cli", "run", str(lip), *args]
        if user:
            cmd[4:4] = ["--as-user", user]
        cmd[4:4] = list(extra)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env,
                              cwd=REPO, input=stdin)

    def shm_names(self) -> list[str]:
        return [n for n in os.listdir("/dev/shm") if f"sym{self.instance}" in n]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        try:
            os.rmdir(self.sock_dir)
        except OSError:
            pass
        return self.proc.returncode


def start_kernels(specs: dict) -> dict:
    """``{name: KernelProc(*args, **kw)}`` for ``specs`` = ``{name: (args, kw)}``, started at once:
    each loads its model on a core of its own (SmolLM2's GGUF metadata alone takes ~6 s of one
    core).  If one fails to start, the others are stopped and its error is raised."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(specs)) as pool:
        starting = {name: pool.submit(KernelProc, *args, **kw) for name, (args, kw) in specs.items()}
    started = {name: f.result() for name, f in starting.items() if f.exception() is None}
    failed = [f.exception() for f in starting.values() if f.exception() is not None]
    if failed:
        stop_kernels(started)
        raise failed[0]
    return started


def stop_kernels(kernels: dict) -> dict:
    """Stop ``kernels`` (a dict of KernelProc) at once; ``{name: exit status}``."""
    from concurrent.futures import ThreadPoolExecutor
    if not kernels:
        return {}
    with ThreadPoolExecutor(len(kernels)) as pool:
        return dict(zip(kernels, pool.map(KernelProc.stop, kernels.values())))


def stopped_cleanly(kernels: dict, codes: dict) -> None:
    """Each of ``kernels`` exited 0 (``codes`` from stop_kernels) and left no shared memory."""
    bad = {name: Path(k.log.name).read_text()[-3000:] for name, k in kernels.items() if codes[name] != 0}
    assert not bad, (codes, bad)
    left = {name: k.shm_names() for name, k in kernels.items() if k.shm_names()}
    assert not left, f"shared memory left behind after shutdown: {left}"


@pytest.fixture(scope="session")
def trust_kernels(tmp_path_factory):
    """The kernels of tests/security/test_trust_kvfs.py ("kvfs") and tests/security/test_trust_limits.py
    ("limits"), each with its module's KERNEL_FLAGS, started at once: the two modules run one
    after the other, and each kernel loads SmolLM2.  Each module stops its own at its end."""
    from security.test_trust_kvfs import KERNEL_FLAGS as kvfs
    from security.test_trust_limits import KERNEL_FLAGS as limits
    ks = start_kernels({"kvfs": ((tmp_path_factory.mktemp("trust"), *kvfs), {}),
                        "limits": ((tmp_path_factory.mktemp("limits"), *limits), {})})
    yield ks
    stop_kernels(ks)


@pytest.fixture
def public_tmp():
    """A temporary directory every user may read (pytest's tmp_path is 0700 under
    /tmp/pytest-of-root): capabilities read files with the LIP's user's own rights,
    so a directory granted to a LIP of another user (or of an accountless name,
    which reads as nobody) must be readable by them.  Removed afterwards."""
    import shutil
    d = Path(tempfile.mkdtemp(prefix="symphony-public-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# a secret in the session kernel's environment: no LIP may see it (tests/security/test_trust_identity.py)
SECRET_ENV = "SYMPHONY_TEST_SECRET"


@pytest.fixture(scope="session")
def kernel(tmp_path_factory, request):
    """The session's kernel on SmolLM2.  While it starts, the in-process model (the smollm
    fixture, which the suite needs too) loads on the other core: each takes a core for seconds."""
    import secrets
    from concurrent.futures import ThreadPoolExecutor
    secret = "envsecret-" + secrets.token_hex(8)
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(KernelProc, tmp_path_factory.mktemp("kernel"), "--process-quota", "128",
                               "--durable-dir", str(tmp_path_factory.mktemp("durable")), env={SECRET_ENV: secret})
        try:
            request.getfixturevalue("smollm")
        except BaseException:
            if starting.exception() is None:
                starting.result().stop()
            raise
        k = starting.result()
    k.secret = secret
    yield k
    k.stop()
    assert k.proc.returncode == 0, k.read_log()[-3000:]
    assert k.shm_names() == [], "shared memory left behind after shutdown"
