"""Tests of symphony.kernel.workers.sandbox.lockdown.

Every test forks a child; only the child locks itself down (seccomp is never
installed in the pytest process).  The child reports through a pipe that was
opened before the fork and is kept across the lockdown, then os._exit()s.
"""
from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor   # imports the lazy .thread submodule

import numpy as np
import pytest

from symphony.kernel.workers.sandbox import bpf
from symphony.kernel.workers.sandbox import lockdown as sandbox
from symphony.kernel.workers.sandbox.lockdown import SandboxError, build_filter, lockdown

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or os.uname().machine not in ("x86_64", "aarch64"),
    reason="seccomp sandbox is Linux x86_64/aarch64 only")

LIBC = ctypes.CDLL(None, use_errno=True)


def vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def run_locked(fn, *, keep=(), timeout=15.0, address_space_bytes=None, cpu_seconds=None,
               open_files=256, before=None, lock=True):
    """Fork; the child locks down, runs fn() and writes json.dumps(result) to a pipe.

    Returns (wait status, decoded result or None)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # child
        code = 0
        try:
            os.close(r)
            ctx = before() if before else None
            if lock:
                lockdown(own_pid=os.getpid(), keep_fds={0, 1, 2, w, *keep},
                         address_space_bytes=address_space_bytes(ctx)
                         if callable(address_space_bytes) else address_space_bytes,
                         cpu_seconds=cpu_seconds, open_files=open_files)
            result = fn(ctx) if before else fn()
            payload = json.dumps({"ok": result})
        except BaseException as e:                 # noqa: BLE001 - report everything
            payload = json.dumps({"exc": type(e).__name__, "errno": getattr(e, "errno", None),
                                  "msg": str(e)})
            code = 3
        try:
            data = payload.encode()
            while data:
                data = data[os.write(w, data):]
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    os.set_blocking(r, False)

    def drain():
        while True:
            try:
                chunk = os.read(r, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            chunks.append(chunk)
    try:
        while True:
            drain()
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                drain()
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("sandboxed child timed out")
            time.sleep(0.005)
    finally:
        os.close(r)
    raw = b"".join(chunks)
    return status, (json.loads(raw) if raw else None)


def expect_ok(fn, **kw):
    status, res = run_locked(fn, **kw)
    assert res is not None, f"child died without reporting (status {status})"
    assert "ok" in res, f"child raised: {res}"
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    return res["ok"]


def expect_exc(fn, exc_names, err=None, **kw):
    status, res = run_locked(fn, **kw)
    assert res is not None, f"child died without reporting (status {status})"
    assert res.get("exc") in exc_names, f"expected {exc_names}, got {res}"
    if err is not None:
        assert res["errno"] == err, res
    return res


def ctypes_call(name, *args):
    def f():
        fn = getattr(LIBC, name)
        ctypes.set_errno(0)
        rc = fn(*args)
        return [rc, ctypes.get_errno()]
    return f


# ---------------------------------------------------------------- the filter itself

def test_filter_is_well_formed():
    for machine in ("x86_64", "aarch64"):
        prog = build_filter(1234, machine=machine)
        assert len(prog) % 8 == 0 and 0 < len(prog) // 8 <= 4096
        insns = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
        for idx, (code, jt, jf, k) in enumerate(insns):
            if code & 0x07 == 0x05:                      # jumps stay inside the program
                assert idx + 1 + max(jt, jf) < len(insns)
        assert insns[-1] == (0x06, 0, 0, bpf.SECCOMP_RET_ERRNO | errno.EPERM)   # default: refuse
    with pytest.raises(SandboxError):
        build_filter(1, machine="riscv64")
    with pytest.raises(SandboxError):
        build_filter(0)


def bpf_eval(prog: bytes, nr: int, args=(0,) * 6, arch=None, machine="x86_64") -> int:
    """A tiny classic-BPF interpreter for the opcodes build_filter emits."""
    if arch is None:
        arch = bpf._ARCHES[machine][1]
    args = tuple(args) + (0,) * (6 - len(args))
    data = struct.pack("=iIQ6Q", nr, arch, 0, *[a & (2**64 - 1) for a in args])
    insns = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x35, 0x45):
            cond = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if cond else jf)
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_filter_decisions(machine):
    own = 4242
    prog = build_filter(own, machine=machine)
    col = 0 if machine == "x86_64" else 1
    nr = lambda name: sandbox.SYSCALLS[name][col]           # noqa: E731
    ALLOW, KILL = bpf.SECCOMP_RET_ALLOW, bpf.SECCOMP_RET_KILL_PROCESS
    err = lambda e: bpf.SECCOMP_RET_ERRNO | e           # noqa: E731
    ev = lambda name, *args: bpf_eval(prog, nr(name), args, machine=machine)  # noqa: E731

    assert ev("read") == ALLOW and ev("futex") == ALLOW
    assert ev("openat") == err(errno.EACCES) and ev("socket") == err(errno.EPERM)
    assert ev("clone3") == err(errno.ENOSYS)
    # clone: threads only, no namespaces
    thread_flags = 0x3D0F00     # what glibc's pthread_create passes
    assert ev("clone", thread_flags) == ALLOW
    assert ev("clone", 0x11) == err(errno.EPERM)                       # fork: SIGCHLD
    assert ev("clone", 0x4111) == err(errno.EPERM)                     # vfork|vm|SIGCHLD
    assert ev("clone", thread_flags | 0x40000000) == err(errno.EPERM)  # + CLONE_NEWNET
    assert ev("clone", thread_flags | 0x10000000) == err(errno.EPERM)  # + CLONE_NEWUSER
    # signals: self only
    assert ev("kill", own, 9) == ALLOW and ev("tgkill", own, 77, 9) == ALLOW
    assert ev("kill", own + 1, 0) == err(errno.EPERM)
    assert ev("kill", 0, 9) == err(errno.EPERM) and ev("kill", -1, 9) == err(errno.EPERM)
    assert ev("tgkill", 1, 1, 9) == err(errno.EPERM) and ev("tkill", 1, 9) == err(errno.EPERM)
    assert ev("rt_sigqueueinfo", 1, 9, 0) == err(errno.EPERM)
    # ioctl / prctl: specific commands only
    assert ev("ioctl", 0, 0x5412) == err(errno.ENOTTY) and ev("ioctl", 0, 0x541B) == ALLOW
    assert ev("ioctl", 0, 0x5401) == err(errno.ENOTTY) and ev("ioctl", 0, 0x5451) == ALLOW
    assert ev("prctl", 35) == err(errno.EPERM) and ev("prctl", 15) == ALLOW
    assert ev("prctl", 1, 9) == err(errno.EPERM) and ev("prctl", 4, 1) == err(errno.EPERM)  # PDEATHSIG, DUMPABLE
    # fcntl: no F_SETOWN / F_SETSIG / F_SETOWN_EX / F_SETLEASE / F_NOTIFY, no O_ASYNC
    for cmd in (0, 1, 2, 3, 1030):
        assert ev("fcntl", 3, cmd) == ALLOW, cmd
    for cmd in (8, 10, 15, 1024, 1026, 1031, 6, 7):
        assert ev("fcntl", 3, cmd) == err(errno.EPERM), cmd
    assert ev("fcntl", 3, 4, 0x800) == ALLOW                        # F_SETFL O_NONBLOCK
    assert ev("fcntl", 3, 4, 0x2000 | 0x800) == err(errno.EPERM)    # F_SETFL O_ASYNC
    # no new executable memory
    assert ev("mmap", 0, 4096, 3, 0x22) == ALLOW and ev("mprotect", 0, 4096, 0) == ALLOW
    assert ev("mmap", 0, 4096, 7, 0x22) == err(errno.EPERM)
    assert ev("mprotect", 0, 4096, 5) == err(errno.EPERM)
    # path lookups refused outright, fstat kept (glibc's fstat is newfstatat)
    assert ev("newfstatat", 3, 0, 0, 0x1000) == ALLOW and ev("fstat") == ALLOW     # fstat(3)
    assert ev("newfstatat", -100 & 0xFFFFFFFF, 0, 0, 0) == err(errno.EACCES)      # stat(path)
    assert ev("newfstatat", -100 & 0xFFFFFFFF, 0, 0, 0x100) == err(errno.EACCES)  # lstat(path)
    assert ev("newfstatat", -100 & 0xFFFFFFFF, 0, 0, 0x1000) == err(errno.EACCES)
    assert ev("readlinkat") == err(errno.EACCES) and ev("faccessat") == err(errno.EACCES)
    assert ev("statx") == err(errno.ENOSYS)
    # prlimit64: reading is fine, setting is not (pointer checked on all 64 bits)
    assert ev("prlimit64", 0, 7, 0, 0x7FFF0000) == ALLOW
    assert ev("prlimit64", 0, 7, 0x7FFF00000000) == err(errno.EPERM)
    assert ev("prlimit64", 0, 7, 0x1000) == err(errno.EPERM)
    assert ev("prlimit64", own, 7, 0) == ALLOW and ev("prlimit64", 1, 7, 0) == err(errno.EPERM)
    assert ev("sched_getaffinity", 0) == ALLOW and ev("sched_getaffinity", own) == ALLOW
    assert ev("sched_getaffinity", 1) == err(errno.EPERM)
    assert ev("sched_setaffinity", 0) == err(errno.EPERM)
    # foreign ABI
    assert bpf_eval(prog, 20, arch=0x40000003) == KILL                # AUDIT_ARCH_I386
    if machine == "x86_64":
        assert bpf_eval(prog, 0x40000000 | 39) == KILL                # x32
        assert ev("fork") == err(errno.EPERM) and ev("open") == err(errno.EACCES)
    # an allow list: everything unlisted is refused
    assert bpf_eval(prog, 9999, machine=machine) == err(errno.EPERM)
    for name in ("setresuid", "setgroups", "ptrace", "memfd_create", "wait4", "mlock", "splice",
                 "io_uring_setup", "bpf", "unshare", "getsockopt", "sendmsg", "flock", "chdir"):
        assert ev(name) == err(errno.EPERM), name
    for name in sandbox.ALLOW:
        if sandbox.SYSCALLS[name][col] is not None:
            assert ev(name) == ALLOW, name


def _header_numbers(path, pattern):
    try:
        text = open(path).read()
    except OSError:
        return None
    return {m.group(1): int(m.group(2)) for m in re.finditer(pattern, text)}


def test_syscall_numbers_match_kernel_headers():
    x86 = _header_numbers("/usr/include/x86_64-linux-gnu/asm/unistd_64.h",
                          r"#define __NR_(\w+) (\d+)\n")
    gen = _header_numbers("/usr/include/asm-generic/unistd.h",
                          r"#define __NR(?:3264)?_(\w+) (\d+)\n")
    if not x86 and not gen:
        pytest.skip("no kernel headers")
    checked = 0
    for name, (nx, na) in sandbox.SYSCALLS.items():
        if x86 and name in x86:
            assert nx == x86[name], name
            checked += 1
        if gen and name in gen:
            assert na == gen[name], name
            checked += 1
    assert checked > 100


def test_bad_arguments_raise_sandbox_error():
    status, res = run_locked(lambda: None, lock=False,
                             before=lambda: lockdown(own_pid=-1, keep_fds=set(),
                                                     address_space_bytes=None,
                                                     cpu_seconds=None, open_files=None))
    assert res["exc"] == "SandboxError"


# ---------------------------------------------------------------- denied

def test_socket_denied():
    expect_exc(lambda: socket.socket(), {"PermissionError"}, errno.EPERM)
    expect_exc(lambda: socket.socketpair(), {"PermissionError"}, errno.EPERM)


def test_exec_denied():
    expect_exc(lambda: os.execv("/bin/true", ["/bin/true"]), {"PermissionError"}, errno.EPERM)


def test_fork_denied_and_fork_bomb_stops_at_once():
    expect_exc(lambda: os.fork(), {"PermissionError"}, errno.EPERM)

    def bomb():
        n = 0
        try:
            while n < 20:                   # bounded even if the sandbox were broken
                if os.fork() == 0:
                    os._exit(0)
                n += 1
        except PermissionError:
            return n
        return n
    assert expect_ok(bomb) == 0


def test_subprocess_denied():
    expect_exc(lambda: subprocess.run(["/bin/true"]), {"PermissionError"}, errno.EPERM)
    expect_exc(lambda: os.posix_spawn("/bin/true", ["/bin/true"], {}), {"PermissionError"})


def test_open_denied():
    expect_exc(lambda: open("/etc/passwd").read(), {"PermissionError"}, errno.EACCES)
    expect_exc(lambda: os.open("/tmp/x-sandbox", os.O_CREAT | os.O_WRONLY),
               {"PermissionError"}, errno.EACCES)


def test_import_of_unloaded_module_fails():
    name = "colorsys"
    if name in sys.modules:
        pytest.skip(f"{name} already imported")
    expect_exc(lambda: __import__(name), {"PermissionError", "ModuleNotFoundError",
                                          "ImportError"})


def test_kill_only_self():
    expect_exc(lambda: os.kill(os.getppid(), 0), {"PermissionError"}, errno.EPERM)
    expect_exc(lambda: os.kill(1, 0), {"PermissionError"}, errno.EPERM)
    expect_exc(lambda: os.kill(-1, 0), {"PermissionError"}, errno.EPERM)
    assert expect_ok(lambda: os.kill(os.getpid(), 0)) is None

    got = []

    def self_signal():
        signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
        os.kill(os.getpid(), signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR1)           # tgkill(own_pid, tid)
        return len(got)
    assert expect_ok(self_signal) == 2


def test_unlink_denied(tmp_path):
    p = tmp_path / "victim"
    p.write_text("x")
    expect_exc(lambda: os.unlink(p), {"PermissionError"}, errno.EPERM)
    expect_exc(lambda: os.rename(p, tmp_path / "other"), {"PermissionError"}, errno.EPERM)
    expect_exc(lambda: os.mkdir(tmp_path / "d"), {"PermissionError"}, errno.EPERM)
    expect_exc(lambda: os.chmod(p, 0o777), {"PermissionError"}, errno.EPERM)
    assert p.read_text() == "x"


def test_mount_and_friends_denied():
    eperm = [-1, errno.EPERM]
    assert expect_ok(ctypes_call("mount", b"none", b"/mnt", b"tmpfs", 0, None)) == eperm
    assert expect_ok(ctypes_call("unshare", 0x00020000)) == eperm          # CLONE_NEWNS
    assert expect_ok(ctypes_call("chroot", b"/tmp")) == eperm
    assert expect_ok(ctypes_call("setuid", 1000)) == eperm
    assert expect_ok(ctypes_call("ptrace", 0, 0, None, None)) == eperm    # PTRACE_TRACEME
    assert expect_ok(ctypes_call("ftruncate", 1, 0)) == eperm
    # clone3 -> ENOSYS (glibc falls back to clone for threads)
    clone3 = sandbox.SYSCALLS["clone3"][0 if os.uname().machine == "x86_64" else 1]
    assert expect_ok(ctypes_call("syscall", clone3, None, 0)) == [-1, errno.ENOSYS]
    # setrlimit may not raise (or change) limits; reading them is fine
    import resource
    expect_exc(lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)),
               {"PermissionError", "ValueError", "OSError"})
    assert expect_ok(lambda: resource.getrlimit(resource.RLIMIT_NOFILE)) == [256, 256]


def test_tiocsti_denied():
    assert expect_ok(ctypes_call("ioctl", 0, 0x5412, ctypes.c_char_p(b"x"))) == [-1, errno.ENOTTY]


def test_x86_foreign_abi_kills():
    if os.uname().machine != "x86_64":
        pytest.skip("x86_64 only")
    # an x32 syscall number (getpid | __X32_SYSCALL_BIT) kills the process
    status, res = run_locked(ctypes_call("syscall", 0x40000000 | 39))
    assert res is None and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSYS


# ---------------------------------------------------------------- allowed

def test_threads_numpy_sleep_mmap_pipes_ipc():
    import posix_ipc
    name = f"/symphony-sandbox-test-{os.getpid()}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=4096)
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, initial_value=0)
    shm_map = mmap.mmap(shm.fd, 4096)
    shm.close_fd()
    pr, pw = os.pipe()
    try:
        def work():
            out = {}
            with ThreadPoolExecutor(8) as ex:
                out["pool"] = sum(ex.map(lambda i: sum(range(i * 1000)), range(32)))
            box = []
            t = threading.Thread(target=lambda: box.append(threading.get_native_id()))
            t.start()
            t.join()
            out["thread"] = len(box)
            a = np.arange(256 * 256, dtype=np.float64).reshape(256, 256) / 1e4
            out["matmul"] = float((a @ a).sum())
            t0 = time.monotonic()
            time.sleep(0.02)
            out["slept"] = time.monotonic() - t0 >= 0.015
            m = mmap.mmap(-1, 1 << 20)
            m[:5] = b"hello"
            out["mmap"] = bytes(m[:5]).decode()
            m.close()
            os.write(pw, b"ping")
            out["pipe"] = os.read(pr, 4).decode()
            shm_map[:6] = b"LIP-ok"
            sem.release()
            sem.acquire(0)
            sem.release()
            out["cpu_count"] = os.cpu_count()
            out["random"] = len(os.urandom(16))
            return out

        res = expect_ok(work, keep=(pr, pw), address_space_bytes=lambda _: vm_size() + (2 << 30),
                        cpu_seconds=30)
        a = np.arange(256 * 256, dtype=np.float64).reshape(256, 256) / 1e4
        assert res["pool"] == sum(sum(range(i * 1000)) for i in range(32))
        assert res["thread"] == 1
        assert res["matmul"] == pytest.approx(float((a @ a).sum()))
        assert res["slept"] and res["mmap"] == "hello" and res["pipe"] == "ping"
        assert res["random"] == 16
        assert bytes(shm_map[:6]) == b"LIP-ok"
        sem.acquire(1)                      # the child left the semaphore at 1
    finally:
        os.close(pr)
        os.close(pw)
        shm_map.close()
        shm.unlink()
        sem.unlink()
        sem.close()


def test_tsync_covers_threads_started_before_lockdown():
    def before():
        ev = threading.Event()
        box = []

        def waiter():
            ev.wait()
            try:
                socket.socket()
                box.append("allowed")
            except OSError as e:
                box.append(e.errno)
        t = threading.Thread(target=waiter)
        t.start()
        return ev, t, box

    def after(ctx):
        ev, t, box = ctx
        ev.set()
        t.join()
        return box
    assert expect_ok(after, before=before) == [errno.EPERM]


def test_address_space_limit():
    def hog(limit):
        try:
            bytearray(2 * limit)
        except MemoryError:
            return "MemoryError"
        return "allocated"

    def limit_from_vm():
        return vm_size() + (256 << 20)

    assert expect_ok(hog, before=limit_from_vm, address_space_bytes=lambda lim: lim) \
        == "MemoryError"


def test_cpu_limit_kills_busy_loop():
    def spin():
        while True:
            pass
    t0 = time.monotonic()
    status, res = run_locked(spin, cpu_seconds=1, timeout=10)
    assert res is None
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL)
    assert time.monotonic() - t0 < 8


def test_unkept_fds_are_closed():
    r, w = os.pipe()
    try:
        def probe():
            out = []
            for fd in (r, w):
                try:
                    os.fstat(fd)
                    out.append("open")
                except OSError as e:
                    out.append(errno.errorcode[e.errno])
            return out
        assert expect_ok(probe, keep=(w,)) == ["EBADF", "open"]
    finally:
        os.close(r)
        os.close(w)


def test_fsize_zero_fails_with_efbig_not_signal(tmp_path):
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)
    try:
        expect_exc(lambda: os.write(fd, b"x"), {"OSError"}, errno.EFBIG, keep=(fd,))
    finally:
        os.close(fd)


def test_allow_list_refuses_what_a_lip_does_not_need():
    pr, pw = os.pipe()
    try:
        def probe():
            out = {}
            out["fstat"] = os.fstat(pw).st_mode != 0                    # fstat is fine
            out["access"] = os.access("/", os.F_OK)                     # False: refused
            for name, fn in (("stat", lambda: os.stat("/")), ("lstat", lambda: os.lstat("/")),
                             ("readlink", lambda: os.readlink("/proc/self/exe")),
                             ("memfd", lambda: os.memfd_create("x")),
                             ("setuid", lambda: os.setuid(0))):
                try:
                    fn()
                    out[name] = "allowed"
                except OSError as e:
                    out[name] = e.errno
            out["setown"] = ctypes_call("fcntl", pr, 8, os.getpid())()           # F_SETOWN
            out["setsig"] = ctypes_call("fcntl", pr, 10, 9)()                    # F_SETSIG
            fl = LIBC.fcntl(pr, 3, 0)
            out["async"] = ctypes_call("fcntl", pr, 4, fl | 0o20000)()           # O_ASYNC
            out["nonblock"] = ctypes_call("fcntl", pr, 4, fl | os.O_NONBLOCK)()
            LIBC.mmap.restype = ctypes.c_void_p
            LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_long]
            ctypes.set_errno(0)
            p = LIBC.mmap(None, 4096, 7, 0x22, -1, 0)                            # RWX anonymous
            out["exec_mmap"] = [p == ctypes.c_void_p(-1).value, ctypes.get_errno()]
            out["pdeathsig"] = ctypes_call("prctl", 1, 9, 0, 0, 0)()
            return out

        res = expect_ok(probe, keep=(pr, pw))
        assert res["fstat"] is True
        assert res["stat"] == res["lstat"] == res["readlink"] == errno.EACCES, res
        assert res["access"] is False
        assert res["memfd"] == res["setuid"] == errno.EPERM, res
        for k in ("setown", "setsig", "async", "pdeathsig"):
            assert res[k] == [-1, errno.EPERM], (k, res)
        assert res["nonblock"][0] == 0
        assert res["exec_mmap"] == [True, errno.EPERM]
    finally:
        os.close(pr)
        os.close(pw)
