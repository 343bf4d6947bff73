"""Building the C++/CUDA ops: sources, compiler flags per CPU, the build cache and its lock.

The sources are ``csrc/``: the copy shipped inside an installed wheel as ``symphony/_csrc``, or
the checkout's top-level ``csrc/`` (a source checkout or an editable install). They are compiled
with ``torch.utils.cpp_extension`` into ``$SYMPHONY_BUILD_DIR`` or ``~/.cache/symphony/ops/<hash>``
(the hash covers the sources' bytes and the whole toolchain: the interpreter, torch and where it
is installed, the compiler, the flags and the CPU signature; `toolchain`) under a file lock, so
concurrent first users build once, and each virtualenv or interpreter using the same cache
builds once: switching between them does not rebuild. The build compiles a copy of the sources kept by
content, ``~/.cache/symphony/src/<hash of their bytes>``, so the compiled paths do not depend on
where the sources came from: a checkout, its worktrees and an installed wheel with the same sources
share one build (and a copied build directory stays up to date) instead of rebuilding it in turn
for each path.
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
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger("symphony.ops")

_EXT_NAME = "symphony_ops"
_PACKAGED_CSRC = Path(__file__).resolve().parents[2] / "_csrc"   # site-packages/symphony/_csrc (a wheel)
_CHECKOUT_CSRC = Path(__file__).resolve().parents[3] / "csrc"    # <repo>/csrc (a checkout, -e install)
_SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".cuh", ".hpp", ".inc")
_CPU_SOURCES = ("ops.cpp", "cpu/paged_attention.cpp", "cpu/qlinear.cpp", "cpu/qkernels_x86.cpp", "cpu/qlinear_q8.cpp",
                "cpu/qkernels_q8_x86.cpp", "cpu/qkernels_t16_x86.cpp", "cpu/norm.cpp", "cpu/fused.cpp",
                "cpu/layers.cpp", "cpu/qkernels_t16_avx2.cpp", "cpu/qkernels_rows_avx2.cpp",
                "cpu/attention_amx.cpp")
_CUDA_SOURCES = ("cuda/paged_attention.cu", "cuda/qlinear.cu", "cuda/dense.cu", "cuda/attention_tiled.cu",
                 "cuda/gemv_tc.cu")
_LOCK_TIMEOUT_S = 30 * 60        # default wait for another live builder ($SYMPHONY_BUILD_LOCK_TIMEOUT)
_LOCK_PROGRESS_S = 10.0

def csrc_dir() -> Path:
    """The directory holding the C++/CUDA sources: the copy an installed wheel ships
    (``symphony/_csrc``), else the checkout's ``csrc/``; RuntimeError if neither has ops.cpp."""
    for d in (_PACKAGED_CSRC, _CHECKOUT_CSRC):
        if (d / "ops.cpp").is_file():
            return d
    raise RuntimeError(
        f"symphony: the C++ op sources were not found: neither {_PACKAGED_CSRC} (an installed "
        f"wheel's copy) nor {_CHECKOUT_CSRC} (a source checkout) has ops.cpp. Reinstall symphony "
        "from a wheel or sdist built with setup.py, or run from a source checkout.")


def _source_files(root: Path) -> list[Path]:
    """Every C++/CUDA source and header under ``root``, sorted."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _SOURCE_SUFFIXES)


def _read_sources(root: Path) -> tuple[str, dict[str, bytes]]:
    """The sources under ``root`` (relative path -> bytes) and the sha256 of them all."""
    files = {str(p.relative_to(root)): p.read_bytes() for p in _source_files(root)}
    h = hashlib.sha256()
    for rel, data in files.items():
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest(), files


def _stage_sources(root: Path, cache: Optional[Path] = None) -> Path:
    """A copy of the sources of ``root`` kept by content: ``<cache>/<hash of their bytes>``
    (default ``~/.cache/symphony/src``), written once (built in a temporary directory, then
    renamed into place, so a staged copy is complete or absent) and never changed after; the
    build compiles it, so its paths are the same wherever the sources came from. Where the
    cache cannot be written, ``root`` itself."""
    digest, files = _read_sources(root)          # hashed and copied from the same bytes
    cache = cache or Path.home() / ".cache" / "symphony" / "src"
    dst = cache / digest[:16]
    if dst.is_dir():
        return dst
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".staging-", dir=cache))
    except OSError as e:
        logger.info("cannot stage the op sources in %s (%s); building them where they are", cache, e)
        return root
    try:
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, dst)
        except OSError:
            if not dst.is_dir():                 # not another process staging the same bytes first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


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
    return Path.home() / ".cache" / "symphony" / "ops" / build_hash(with_cuda)


def build_hash(with_cuda: bool) -> str:
    """What a build of the ops is made of, 16 hex digits (the default build directory's name):
    the sources' bytes and everything `toolchain` names (interpreter, torch, compiler, flags,
    CPU). Each environment gets a directory of its own, and one that comes back finds its
    build where it left it: cpp_extension rewrites a directory's build.ninja, and rebuilds
    everything, whenever the compiler or an include path in it changes."""
    h = hashlib.sha256(b"staged sources\n")    # compiled from ~/.cache/symphony/src/<hash>
    h.update(_read_sources(csrc_dir())[0].encode())
    for k, v in sorted(toolchain(with_cuda).items()):
        h.update(f"{k}={v}\n".encode())
    return h.hexdigest()[:16]


def toolchain(with_cuda: bool) -> dict[str, str]:
    """Everything besides the sources that changes a build of the ops: the interpreter (version,
    extension suffix, C headers), torch (version, commit, where it is installed: its headers
    and libraries, the C++ ABI), the C++ compiler (``$CXX`` or c++, resolved, and what its
    --version says), the compiler flags and the CPU signature (-march=native); with CUDA also
    the CUDA version, nvcc and ``$TORCH_CUDA_ARCH_LIST``."""
    out = {
        "python": sys.version.replace("\n", " "),
        "python_ext": str(sysconfig.get_config_var("EXT_SUFFIX")),
        "python_include": str(sysconfig.get_paths().get("include")),
        "torch": torch.__version__,
        "torch_git": str(getattr(torch.version, "git_version", "")),
        "torch_dir": str(Path(torch.__file__).resolve().parent),
        "cxx11_abi": str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
        "cxx": _compiler_id(os.environ.get("CXX") or "c++"),
        "cflags": " ".join(_cflags()),
        "cpu": _cpu_signature(),
        "cuda": str(with_cuda),
    }
    if with_cuda:
        out.update(cuda_version=str(torch.version.cuda), cuda_flags=" ".join(_cuda_flags()),
                   nvcc=_compiler_id(_find_nvcc() or "nvcc"),
                   arch_list=os.environ.get("TORCH_CUDA_ARCH_LIST", ""))
    return out


_compiler_ids: dict[str, str] = {}


def _compiler_id(cmd: str) -> str:
    """A compiler as it resolves on PATH, and the first line of its --version (once a process)."""
    if cmd not in _compiler_ids:
        exe = shutil.which(cmd)
        where = os.path.realpath(exe) if exe else cmd
        try:
            proc = subprocess.run([exe or cmd, "--version"], capture_output=True, text=True, timeout=30)
            version = (proc.stdout.strip().splitlines() or ["?"])[0]
        except (OSError, subprocess.SubprocessError):
            version = "not found"
        _compiler_ids[cmd] = f"{where} ({version})"
    return _compiler_ids[cmd]


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
    names = list(_CPU_SOURCES) + (list(_CUDA_SOURCES) if with_cuda else [])
    for s in names:
        if not (root / s).is_file():
            raise RuntimeError(f"symphony: op source {root / s} is missing")
    build_dir = _build_dir(with_cuda)
    build_dir.mkdir(parents=True, exist_ok=True)  # cpp_extension's lock file lives in it
    with _build_lock(build_dir):
        staged = _stage_sources(root)
        _load_locked(build_dir, [str(staged / s) for s in names], with_cuda, staged)
    global loaded_build
    loaded_build = (build_dir, build_hash(with_cuda))


# (build directory, build_hash) of the library this process loaded; None before it did
loaded_build: Optional[tuple[Path, str]] = None


def _load_locked(build_dir: Path, sources: list, with_cuda: bool, root: Path) -> None:
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


def _find_nvcc() -> Optional[str]:
    from torch.utils import cpp_extension
    nvcc = shutil.which("nvcc")
    if nvcc is None and cpp_extension.CUDA_HOME:
        cand = Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"
        if cand.exists():
            nvcc = str(cand)
    return nvcc


def compile_cuda_object(out_dir, arch: str = "sm_90", source: str = "paged_attention.cu",
                        extra_flags: tuple = (), log: Optional[list] = None) -> Path:
    """Compile csrc/cuda/<source> to an object file with nvcc; returns its path.

    Proves the CUDA kernels compile on a machine without a GPU (or a CUDA build of torch).
    ``extra_flags`` go to nvcc (e.g. ``("-Xptxas", "-v")``: registers and spills per kernel);
    ``log``, a list, receives nvcc's output.
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
    cmd += list(extra_flags)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if log is not None:
        log.append(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"symphony: nvcc failed ({proc.returncode}):\n{' '.join(cmd)}\n"
                           f"{proc.stdout}\n{proc.stderr}")
    return obj
