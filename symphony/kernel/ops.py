"""Symphony's custom attention ops: loader, typed wrappers, fake impls and references.

The ops are C++/CUDA kernels in ``<repo>/csrc`` registered as ``torch.ops.symphony.*``
(schemas in ``csrc/ops.cpp``). They are compiled on first use with
``torch.utils.cpp_extension`` into a cache directory (``$SYMPHONY_BUILD_DIR`` or
``~/.cache/symphony/ops/<hash>``) and loaded into the process as a plain shared library.

KV page pool layout of one layer: ``k_cache`` / ``v_cache`` are
``[num_pages, page_size, n_kv_heads, head_dim]`` (views ``pool[layer, 0]`` / ``pool[layer, 1]``
of a contiguous pool). Cache slot ``s`` is page ``s // page_size``, offset ``s % page_size``.

``write_kv(k, v, k_cache, v_cache, slots)``
    ``k``, ``v``: ``[T, n_kv_heads, head_dim]``; ``slots``: int64 ``[T]``. Writes ``k[t]``,
    ``v[t]`` at slot ``slots[t]``; negative slots are skipped.

``paged_attention(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale) -> out``
    ``q``: ``[T, n_heads, head_dim]`` holding every sequence's query tokens back to back;
    ``page_table``: int32 ``[B, max_pages]``; ``cu_q_lens``: int32 ``[B + 1]`` (sequence b's
    queries are ``q[cu_q_lens[b]:cu_q_lens[b + 1]]``); ``kv_lens``: int32 ``[B]``, the number of
    cache slots of sequence b, its new tokens included. Query i of a sequence sees slots
    ``0 .. kv_len - q_len + i``; query head h uses kv head ``h // (n_heads // n_kv_heads)``.
    Returns ``softmax(scale * q k^T) v`` as ``[T, n_heads, head_dim]`` in q's dtype, computed
    with float32 accumulation.

q, k and v may be strided along the token dimension (slices of a fused qkv projection) as long
as each token's ``[heads, head_dim]`` block is contiguous.

Dtypes: float32, float16 and bfloat16, on the CPU and on CUDA; q, k, v and the caches share
one dtype. ``write_kv`` copies rows bit-exactly. ``paged_attention`` computes the softmax and
its accumulations in float32 and rounds the output to q's dtype once. On the CPU, with float16 /
bfloat16 caches the decode kernel (sequences with at most 8 query rows per KV head) reads the
cache directly, widening a vector at a time; for the other (prefill-like) sequences the pages
they read are widened into float32 scratch pages, each distinct page once (never the whole
pool), for the float32 prefill kernel. Every widening is exact, so the result is the float32
kernel's on the same values, rounded (nearest even) to q's dtype.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch

__all__ = [
    "load",
    "write_kv",
    "paged_attention",
    "qlinear",
    "qdequant",
    "qcpu_features",
    "qlinear_reference",
    "qdequant_reference",
    "write_kv_reference",
    "paged_attention_reference",
    "cuda_available",
    "compile_cuda_object",
    "csrc_dir",
]

logger = logging.getLogger("symphony.ops")

_EXT_NAME = "symphony_ops"
_CSRC = Path(__file__).resolve().parents[2] / "csrc"
_CPU_SOURCES = ("ops.cpp", "cpu/paged_attention.cpp", "cpu/qlinear.cpp", "cpu/qkernels_x86.cpp")
_CUDA_SOURCES = ("cuda/paged_attention.cu", "cuda/qlinear.cu")
_LOCK_TIMEOUT_S = 30 * 60        # default wait for another live builder ($SYMPHONY_BUILD_LOCK_TIMEOUT)
_LOCK_PROGRESS_S = 10.0

_lock = threading.Lock()
_loaded = False
_cuda_built = False


# --------------------------------------------------------------------------------------------
# Build / load
# --------------------------------------------------------------------------------------------
def csrc_dir() -> Path:
    """The directory holding the C++/CUDA sources; raises if it is missing."""
    if not (_CSRC / "ops.cpp").is_file():
        raise RuntimeError(
            f"symphony: the C++ op sources were not found at {_CSRC} (expected csrc/ops.cpp next "
            "to the symphony package). Run from a source checkout of the repository.")
    return _CSRC


def _cpu_arch_flags() -> list[str]:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686", "i386"):
        return ["-march=native"]
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    return []


def _cpu_signature() -> str:
    """What -march=native depends on: a build is only reused on the same kind of CPU."""
    sig = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features", "model name"):
                    sig += "|" + line.strip()
                if key in ("flags", "features"):
                    break
    except OSError:
        sig += "|" + platform.processor()
    return sig


def _want_cuda() -> bool:
    if os.environ.get("SYMPHONY_NO_CUDA", "") not in ("", "0"):
        return False
    if not torch.cuda.is_available():
        return False
    from torch.utils import cpp_extension
    return bool(cpp_extension.CUDA_HOME)


def _cflags() -> list[str]:
    return ["-O3", "-fopenmp", *_cpu_arch_flags()]


def _cxx_std() -> str:
    """The C++ standard torch's headers are written for (torch >= 2.10 builds with C++20)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 10) else "-std=c++17"


def _cuda_flags() -> list[str]:
    # cpp_extension adds -std, --expt-relaxed-constexpr and the __CUDA_NO_HALF_* defines.
    return ["-O3", "-lineinfo"]


def _build_dir(with_cuda: bool) -> Path:
    env = os.environ.get("SYMPHONY_BUILD_DIR")
    if env:
        return Path(env).expanduser()
    h = hashlib.sha256()
    root = csrc_dir()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if path.suffix in (".cpp", ".cu", ".h", ".cuh", ".hpp"):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    h.update(torch.__version__.encode())
    h.update(f"cuda={with_cuda} {torch.version.cuda}".encode())
    h.update(f"py={sys.version_info[:2]}".encode())
    h.update(" ".join(_cflags() + (_cuda_flags() if with_cuda else [])).encode())
    h.update(_cpu_signature().encode())
    return Path.home() / ".cache" / "symphony" / "ops" / h.hexdigest()[:16]


def _lock_timeout() -> float:
    v = os.environ.get("SYMPHONY_BUILD_LOCK_TIMEOUT", "")
    try:
        t = float(v) if v else _LOCK_TIMEOUT_S
    except ValueError:
        raise RuntimeError(f"symphony: SYMPHONY_BUILD_LOCK_TIMEOUT must be seconds, got {v!r}") from None
    if t < 0:
        raise RuntimeError(f"symphony: SYMPHONY_BUILD_LOCK_TIMEOUT must be >= 0, got {v!r}")
    return t


def _proc_start(pid: int) -> str:
    """A process's start time (clock ticks since boot): pid + start time names one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def _owner(path: Path) -> str:
    try:
        pid, start = path.read_text().split()[:2]
    except (OSError, ValueError):
        return "an unknown process"
    alive = _proc_start(int(pid)) == start if pid.isdigit() else False
    return f"pid {pid}" + ("" if alive else " (recorded; that process is gone)")


def _holders(path: Path) -> list[int]:
    """Pids of the processes that have ``path`` open (cpp_extension's builder
    keeps its ``lock`` file open while it builds), found in /proc/*/fd."""
    try:
        st = path.stat()
    except OSError:
        return []
    me, out = os.getpid(), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                f = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (f.st_dev, f.st_ino) == (st.st_dev, st.st_ino):
                out.append(int(pid))
                break
    return out


def _wait(what: str, path: Path, busy, timeout: float) -> None:
    """Wait while ``busy()`` returns a holder description, with progress on
    stderr every 10 s; RuntimeError naming ``path`` after ``timeout`` s."""
    t0, said = time.monotonic(), None
    while (who := busy()):
        waited = time.monotonic() - t0
        if waited >= timeout:
            raise RuntimeError(
                f"symphony: gave up after {waited:.0f} s waiting for the C++ ops build lock {path}, "
                f"held by {who} (a live process is building the ops in {path.parent}; "
                "wait for it, stop it, or raise SYMPHONY_BUILD_LOCK_TIMEOUT)")
        if said is None or waited - said >= _LOCK_PROGRESS_S:
            said = waited
            _announce(f"symphony: waiting for {what} (lock {path}, held by {who}): {waited:.0f} s")
        time.sleep(0.2)


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold ``build_dir/build.flock`` (an flock: the kernel drops it when its
    holder dies, however it dies) around cpp_extension's build and load.

    Holding it, a cpp_extension ``lock`` file in the directory is judged by
    whether a live process has it open (its builder keeps it open while it
    builds; one that does not take this flock, e.g. an older version): none,
    and it is stale, removed at once, never judged by its age.  A live
    builder is waited for, with progress on stderr every 10 s, up to
    $SYMPHONY_BUILD_LOCK_TIMEOUT seconds (default 1800); then a RuntimeError
    names the lock and its holder."""
    path = build_dir / "build.flock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RuntimeError(f"symphony: cannot open the build lock {path}: {e}") from None
    try:
        timeout, t0 = _lock_timeout(), time.monotonic()

        def flock_busy():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return None
            except BlockingIOError:
                return _owner(path)
        _wait("another process building the C++ ops", path, flock_busy, timeout)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {_proc_start(os.getpid())}\n".encode(), 0)
        baton = build_dir / "lock"

        def baton_busy():
            pids = _holders(baton)
            return f"pid {', '.join(map(str, pids))}" if pids else None
        _wait("another process building the C++ ops", baton, baton_busy,
              max(0.0, timeout - (time.monotonic() - t0)))
        if baton.exists():
            _announce(f"symphony: removing stale build lock {baton} (no live process holds it)")
            with contextlib.suppress(FileNotFoundError):
                baton.unlink()
        yield
    finally:
        os.close(fd)                                 # releases the flock


def _announce(msg: str) -> None:
    logger.info(msg)
    # Also straight to stderr, so that users without logging configured see it.
    print(msg, file=sys.stderr, flush=True)


def _build_and_load(with_cuda: bool) -> None:
    root = csrc_dir()
    sources = [str(root / s) for s in _CPU_SOURCES]
    if with_cuda:
        sources += [str(root / s) for s in _CUDA_SOURCES]
    for s in sources:
        if not Path(s).is_file():
            raise RuntimeError(f"symphony: op source {s} is missing")
    build_dir = _build_dir(with_cuda)
    build_dir.mkdir(parents=True, exist_ok=True)  # cpp_extension's lock file lives in it
    with _build_lock(build_dir):
        _load_locked(build_dir, sources, with_cuda)


def _load_locked(build_dir: Path, sources: list, with_cuda: bool) -> None:
    root = csrc_dir()
    fresh = not (build_dir / f"{_EXT_NAME}.so").exists()
    if fresh:
        _announce(f"symphony: building C++ ops (first use, about a minute) in {build_dir}"
                  f"{' with CUDA' if with_cuda else ''}...")
    t0 = time.perf_counter()
    from torch.utils import cpp_extension
    cpp_extension.load(
        name=_EXT_NAME,
        sources=sources,
        extra_cflags=_cflags(),
        extra_cuda_cflags=_cuda_flags() if with_cuda else None,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(root)],
        build_directory=str(build_dir),
        with_cuda=with_cuda,
        is_python_module=False,
        verbose=os.environ.get("SYMPHONY_BUILD_VERBOSE", "") not in ("", "0"),
    )
    dt = time.perf_counter() - t0
    if fresh or dt > 5.0:
        _announce(f"symphony: C++ ops ready in {dt:.1f} s ({build_dir})")


def load() -> None:
    """Build (first use only) and load the ops. Idempotent and thread-safe.

    The CUDA kernels are included when torch sees a GPU and a CUDA toolkit is found
    (``SYMPHONY_NO_CUDA=1`` forces a CPU-only build); if that build fails, a CPU-only build
    is tried so that CPU inference still works.
    """
    global _loaded, _cuda_built
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        with_cuda = _want_cuda()
        if with_cuda:
            try:
                _build_and_load(True)
            except Exception as e:  # noqa: BLE001 - fall back to the CPU kernels, loudly
                logger.warning("symphony: building the CUDA ops failed (%s); falling back to a "
                               "CPU-only build", e)
                print(f"symphony: WARNING: building the CUDA ops failed ({e}); "
                      "falling back to CPU-only ops", file=sys.stderr, flush=True)
                with_cuda = False
        if not with_cuda:
            _build_and_load(False)
        _register_fakes()
        _cuda_built = with_cuda
        _loaded = True


def cuda_available() -> bool:
    """Whether the CUDA kernels were built into the loaded library."""
    load()
    return _cuda_built


# --------------------------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------------------------
def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Write k[t], v[t] into k_cache / v_cache at slots[t] (negative slots skipped), in place."""
    if not _loaded:
        load()
    torch.ops.symphony.write_kv(k, v, k_cache, v_cache, slots)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, cu_q_lens: torch.Tensor, kv_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of packed queries over the paged KV cache; see the module docstring."""
    if not _loaded:
        load()
    return torch.ops.symphony.paged_attention(q, k_cache, v_cache, page_table, cu_q_lens,
                                              kv_lens, float(scale))


def qlinear(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
            kind: int, group: int, path: int = -1) -> torch.Tensor:
    """``x @ W^T`` for a quantized weight W (layout: ``csrc/quant.h``; x float32 ``[M, K]``).

    ``path`` (CPU only): -1 picks by M and the CPU's features; 0 scalar, 1 AVX2, 2 AVX-512
    (register kernels), 3 dequantize + torch GEMM force one (an unsupported one raises).
    """
    if not _loaded:
        load()
    return torch.ops.symphony.qlinear(x, qs, scales, mins, int(kind), int(group), int(path))


def qdequant(qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, kind: int,
             group: int) -> torch.Tensor:
    """The quantized weight W as float32 ``[N, K]``."""
    if not _loaded:
        load()
    return torch.ops.symphony.qdequant(qs, scales, mins, int(kind), int(group))


def qcpu_features() -> dict[str, bool]:
    """Which SIMD paths of qlinear this CPU runs: ``{"avx2": ..., "avx512": ...}``."""
    if not _loaded:
        load()
    bits = int(torch.ops.symphony.qcpu_features())
    return {"avx2": bool(bits & 1), "avx512": bool(bits & 2)}


# Fake (meta) implementations, for torch.compile / FakeTensor tracing. They can only be
# registered once the ops exist, so load() registers them; the C++ library also names this
# module (set_python_module) so that torch imports it when it needs them.
def _write_kv_fake(k, v, k_cache, v_cache, slots) -> None:
    torch._check(k.dim() == 3 and k.shape == v.shape)
    torch._check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape)
    torch._check(slots.dim() == 1 and slots.shape[0] == k.shape[0])
    return None


def _paged_attention_fake(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale):
    torch._check(q.dim() == 3)
    torch._check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape)
    torch._check(page_table.dim() == 2 and kv_lens.dim() == 1 and cu_q_lens.dim() == 1)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _qlinear_fake(x, qs, scales, mins, kind, group, path=-1):
    torch._check(x.dim() == 2 and qs.dim() == 2)
    return torch.empty((x.shape[0], qs.shape[0]), dtype=torch.float32, device=x.device)


def _qdequant_fake(qs, scales, mins, kind, group):
    torch._check(qs.dim() == 2)
    k = qs.shape[1] * (2 if kind == 0 else 1)
    return torch.empty((qs.shape[0], k), dtype=torch.float32, device=qs.device)


_fakes_registered = False


def _ops_exist() -> bool:
    try:
        torch.ops.symphony.write_kv
        torch.ops.symphony.paged_attention
    except (AttributeError, RuntimeError):
        return False
    return True


def _register_fakes() -> None:
    global _fakes_registered
    if _fakes_registered:
        return
    torch.library.register_fake("symphony::write_kv", _write_kv_fake)
    torch.library.register_fake("symphony::paged_attention", _paged_attention_fake)
    torch.library.register_fake("symphony::qlinear", _qlinear_fake)
    torch.library.register_fake("symphony::qdequant", _qdequant_fake)
    _fakes_registered = True


if _ops_exist():  # the library was loaded by other means before this module was imported
    _register_fakes()


# --------------------------------------------------------------------------------------------
# Pure-PyTorch references (tests and documentation)
# --------------------------------------------------------------------------------------------
def write_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Reference write_kv: scatter rows into the flattened [num_pages * page_size] slot axis."""
    keep = slots >= 0
    idx = slots[keep]
    k_cache.view(-1, *k_cache.shape[2:])[idx] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[idx] = v[keep]


def qdequant_reference(qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, kind: int,
                       group: int) -> torch.Tensor:
    """Reference qdequant: unpack the quants, ``scale * q + min`` per group (float32 [N, K]).

    Computed in float64 and rounded once, like the kernels' fused multiply-add (they may differ
    by one float32 ulp where double rounding bites)."""
    if kind == 0:                                   # u4: byte j of a group = elements j, j + 16
        b = qs.view(qs.shape[0], -1, 16).to(torch.int32)                  # [N, G, 16]
        q = torch.cat([b & 0xF, b >> 4], dim=2).reshape(qs.shape[0], -1)  # [N, K]
    else:
        q = qs.to(torch.int32)                                            # [N, K]
    w = q.double() * scales.double().repeat_interleave(group, dim=1)
    if mins.numel():
        w = w + mins.double().repeat_interleave(group, dim=1)
    return w.float()


def qlinear_reference(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                      kind: int, group: int, path: int = -1) -> torch.Tensor:
    """Reference qlinear: float64 product with the dequantized weight, rounded to float32."""
    w = qdequant_reference(qs, scales, mins, kind, group)
    return (x.double() @ w.double().t()).float()


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              page_table: torch.Tensor, cu_q_lens: torch.Tensor,
                              kv_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference paged_attention: per sequence, gather K/V, build the causal mask, softmax."""
    T, n_heads, head_dim = q.shape
    _, page_size, n_kv_heads, _ = k_cache.shape
    group = n_heads // n_kv_heads
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # float32 accumulation
    out = torch.zeros(T, n_heads, head_dim, dtype=q.dtype, device=q.device)
    cu = cu_q_lens.tolist()
    kvl = kv_lens.tolist()
    for b in range(len(kvl)):
        q0, q1, kv_len = cu[b], cu[b + 1], kvl[b]
        q_len = q1 - q0
        if q_len == 0:
            continue
        n_pages = -(-kv_len // page_size)
        pages = page_table[b, :n_pages].long()
        # [kv_len, n_kv_heads, head_dim] -> one K/V head per query head
        k = k_cache[pages].reshape(-1, n_kv_heads, head_dim)[:kv_len].to(acc)
        v = v_cache[pages].reshape(-1, n_kv_heads, head_dim)[:kv_len].to(acc)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qb = q[q0:q1].to(acc)
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale      # [n_heads, q_len, kv_len]
        i = torch.arange(q_len, device=q.device).unsqueeze(1)
        j = torch.arange(kv_len, device=q.device).unsqueeze(0)
        visible = j <= (kv_len - q_len + i)                         # [q_len, kv_len]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


# --------------------------------------------------------------------------------------------
# CUDA compile check (no GPU needed)
# --------------------------------------------------------------------------------------------
def _find_nvcc() -> Optional[str]:
    from torch.utils import cpp_extension
    nvcc = shutil.which("nvcc")
    if nvcc is None and cpp_extension.CUDA_HOME:
        cand = Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"
        if cand.exists():
            nvcc = str(cand)
    return nvcc


def compile_cuda_object(out_dir, arch: str = "sm_90", source: str = "paged_attention.cu") -> Path:
    """Compile csrc/cuda/<source> to an object file with nvcc; returns its path.

    Proves the CUDA kernels compile on a machine without a GPU (or a CUDA build of torch).
    """
    from torch.utils import cpp_extension
    nvcc = _find_nvcc()
    if nvcc is None:
        raise RuntimeError("symphony: nvcc not found (not on PATH, no CUDA_HOME)")
    root = csrc_dir()
    src = root / "cuda" / source
    if not src.is_file():
        raise RuntimeError(f"symphony: CUDA source {src} is missing")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    obj = out_dir / (Path(source).stem + ".cuda.o")
    includes = [*cpp_extension.include_paths(), str(root)]
    cmd = [nvcc, "-c", str(src), "-o", str(obj), _cxx_std(), "-O3", "--expt-relaxed-constexpr",
           "-Xcompiler", "-fPIC",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           "-DTORCH_API_INCLUDE_EXTENSION_H", f"-DTORCH_EXTENSION_NAME={_EXT_NAME}",
           "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
           "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
           f"-gencode=arch=compute_{arch[3:]},code={arch}"]
    torch_inc = Path(cpp_extension.include_paths()[0])
    if not (torch_inc / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        # CPU wheels ship the c10/cuda headers but not this generated one.
        cmd.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    for inc in includes:
        cmd += ["-I", inc]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"symphony: nvcc failed ({proc.returncode}):\n{' '.join(cmd)}\n"
                           f"{proc.stdout}\n{proc.stderr}")
    return obj
