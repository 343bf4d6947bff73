"""Process lockdown for LIP workers: fds, rlimits, identity, capabilities, seccomp-bpf.

A LIP (user program) runs in its own process, forked from a zygote that has
already imported everything a LIP may use.  Before any user code runs, the
worker calls ::

    lockdown(own_pid=os.getpid(), keep_fds={0, 1, 2, bell}, address_space_bytes=...,
             cpu_seconds=..., open_files=..., uid=..., gid=..., max_threads=...,
             parent_pid=zygote_pid)

which, in this order,

1. closes every file descriptor not in ``keep_fds`` (walking /proc/self/fd,
   which still works at that point),
2. applies resource limits (``apply_rlimits``): RLIMIT_AS, RLIMIT_CPU
   (soft = n, hard = n + 1: SIGXCPU first, SIGKILL one second later),
   RLIMIT_NOFILE, RLIMIT_FSIZE = 0 (no file may grow; SIGXFSZ is ignored so
   such a write fails with EFBIG instead of killing the LIP), RLIMIT_CORE = 0,
   and RLIMIT_NPROC = ``max_threads`` (it binds once the process is not root:
   each LIP has a uid of its own, so it counts exactly that LIP's threads),
3. switches to the LIP's own ``uid`` / ``gid`` (``drop_identity``: no
   supplementary groups, real = effective = saved), when given,
4. PR_SET_PDEATHSIG(SIGKILL) towards ``parent_pid`` (``die_with_parent``; after
   the uid switch, which clears it), so a worker never outlives its zygote,
5. drops every Linux capability of the (single, freshly forked) thread
   (skip with ``drop_caps=False``; matters when no uid switch happened),
6. sets PR_SET_NO_NEW_PRIVS and installs a seccomp-bpf **allow list**, built
   here with ``struct``, with SECCOMP_FILTER_FLAG_TSYNC so that every thread of
   the process gets it.  The filter can never be removed; it is inherited by
   every thread the LIP creates.

Any failure raises ``SandboxError``; the worker must then exit rather than run
user code.

Why our own BPF builder, not libseccomp: the maintained Python binding
(``seccomp``, from libseccomp's source tree) is not on PyPI (Debian ships it as
python3-seccomp, which a virtualenv cannot use), and ``pyseccomp`` is a ctypes
shim that still needs the system's libseccomp.so.2, which a fresh machine may
lack; neither installs from setup.py alone.  The filter here is small, its
syscall numbers are checked against the kernel headers by the tests, and the
tests run every rule through a BPF interpreter.

Filter
------
First the architecture is checked: the filter is built for the running arch
(x86-64 or AArch64) and a syscall made through any other ABI (i386 ``int 0x80``
on x86-64, AArch32 compat on arm64, or x86-64's x32 numbers >= 0x40000000)
kills the whole process (SECCOMP_RET_KILL_PROCESS).  Then the syscall number
is looked up; **anything not listed fails with EPERM** (ENOSYS / EACCES /
ENOTTY where that reads better to Python).  The list is what a zygote-forked
Python LIP (numpy, threads, llguidance, tokenizers) was seen to need, under
strace, running the stock LIPs and the tests' LIPs:

=============================  ===============  ===============================================
syscalls                       result           why
=============================  ===============  ===============================================
read, write, readv, writev,    allowed          I/O on fds the LIP already has (its ring's
pread64, pwrite64, preadv(2),                   doorbell, /dev/null, pipes it makes)
pwritev(2), lseek, close
futex, sched_yield, nanosleep, allowed          threads, locks, sleeping, time
clock_*, gettimeofday, time,
getitimer, setitimer, alarm,
timer_*, timerfd_*
munmap, mremap, madvise, brk,  allowed          memory management
msync, mincore
mmap, mprotect                 EPERM if         no new executable memory (nothing in a LIP
                               PROT_EXEC        needs it once the zygote has loaded the libraries)
rt_sig*, sigaltstack,          allowed          signal handling in the process itself
signalfd(4)
set_robust_list, rseq,         allowed          thread start-up / exit (glibc)
set_tid_address, membarrier,
restart_syscall, exit,
exit_group
clone                          EPERM unless     threads only: flags must contain CLONE_THREAD
                               a thread         and no CLONE_NEW* namespace flag
clone3                         ENOSYS           flags live in memory, uninspectable; glibc
                                                then falls back to clone
get*id, getres*id, getgroups,  allowed          harmless queries
getpgid, getsid, uname,
getrusage, times, sysinfo,
getcpu, getpriority, getrlimit,
capget, sched_get*, getcwd,
getrandom
pipe(2), eventfd(2), epoll_*,  allowed          in-process plumbing (threading, queues)
poll, ppoll, select, pselect6,
dup, dup2, dup3
fstat                          allowed          on fds the LIP has
newfstatat                     EACCES unless    glibc's fstat(fd) is newfstatat(fd, "",
                               AT_EMPTY_PATH,   AT_EMPTY_PATH), which stays allowed; os.stat /
                               dirfd not        lstat of a path are refused.  (A raw call can
                               AT_FDCWD         still name a path with AT_EMPTY_PATH; the LIP's
                                                own uid then keeps root-only paths out of reach)
stat, lstat, access,           EACCES           no path lookups (the LIP has no file system)
faccessat(2), readlink(at),
open, openat, openat2, creat
statx                          ENOSYS           Rust's std then falls back to fstat
kill, tkill, tgkill,           EPERM unless     a LIP may signal itself only (and a
rt_sigqueueinfo,               target is self   different uid could not signal others anyway)
rt_tgsigqueueinfo
sched_getaffinity              EPERM unless     self only
                               pid is 0 / self
prlimit64                      EPERM unless     reading its own limits only
                               pid 0/self and
                               new_limit NULL
fcntl                          EPERM unless     F_DUPFD(_CLOEXEC), F_GETFD, F_SETFD, F_GETFL,
                               allowed cmd      F_SETFL without O_ASYNC, F_GETPIPE_SZ,
                                                F_GET_SEALS; never F_SETOWN(_EX), F_SETSIG,
                                                F_SETLEASE, F_NOTIFY (signals to others)
ioctl                          ENOTTY unless    FIONREAD, FIONBIO, FIOCLEX, FIONCLEX only
                               allowed cmd      (isatty() reads "not a terminal"; no TIOCSTI)
prctl                          EPERM unless     PR_GET_DUMPABLE, PR_SET/GET_NAME,
                               allowed option   PR_GET_SECCOMP, PR_CAPBSET_READ,
                                                PR_GET_TIMERSLACK, PR_GET_NO_NEW_PRIVS,
                                                PR_GET_THP_DISABLE, PR_SET_VMA (naming
                                                anonymous memory)
arch_prctl (x86-64)            allowed          TLS set-up
everything else                EPERM            sockets, fork/exec, wait, ptrace, identity and
                                                limit changes, file system changes, mounts,
                                                namespaces, memfd_create, mlock, splice & co,
                                                io_uring, bpf, perf, keyrings, SysV and POSIX
                                                IPC, module loading, time setting, ...
=============================  ===============  ===============================================

What a LIP author should know
-----------------------------
* No file system.  ``open`` fails with PermissionError (EACCES).  ``import``
  works only for modules the zygote has already imported; importing anything
  else fails (PermissionError or ModuleNotFoundError).  Beware of packages
  that import lazily: e.g. ``concurrent.futures.ThreadPoolExecutor`` lives in
  the lazily imported ``concurrent.futures.thread``, ``numpy.random`` is loaded
  on first attribute access; the zygote must import such submodules itself.
* No sockets.  Talk to the outside world through the kernel's http capability.
* No subprocesses: ``os.fork``, ``subprocess``, ``os.system``, ``os.exec*``,
  ``multiprocessing`` all fail with PermissionError.
* Threads are allowed (``threading``, ``concurrent.futures``), up to the
  kernel's thread cap (RLIMIT_NPROC) and within the CPU-time limit, which
  counts all threads together.
* Signals: only to yourself (``os.kill(os.getpid(), ...)``, ``signal.raise_signal``).
* Memory: bounded by RLIMIT_AS; exceeding it raises MemoryError.
* Reaching the CPU-time limit kills the process (SIGXCPU, then SIGKILL).
* ``os.environ`` is a minimal fixed environment, never the kernel's.
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import threading

from symphony.kernel.workers.sandbox import SandboxError
from symphony.kernel.workers.sandbox.bpf import (ALLOW, RULES, SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_KILL_THREAD, SYSCALLS, _arch, _nr,
                  build_filter)

__all__ = ["SandboxError", "apply_rlimits", "drop_capabilities", "drop_identity", "die_with_parent",
           "install_seccomp", "lockdown", "build_filter", "SYSCALLS", "ALLOW", "RULES"]

PR_SET_NO_NEW_PRIVS = 38
PR_SET_PDEATHSIG = 1
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_GET_ACTION_AVAIL = 2
SECCOMP_FILTER_FLAG_TSYNC = 1
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

# --------------------------------------------------------------------------------------
# libc plumbing

class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


# Resolved at import (in the zygote), so nothing needs the file system later.
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long
    _prctl = _libc.prctl
    _prctl.restype = ctypes.c_int
    _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                       ctypes.c_ulong]
except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
    _libc = None


def _need_libc():
    if _libc is None:
        raise SandboxError("seccomp sandbox: libc (syscall, prctl) not available")


def _oserror(what: str) -> SandboxError:
    e = ctypes.get_errno()
    return SandboxError(f"{what} failed: [errno {e}] {os.strerror(e)}")


def _seccomp(op: int, flags: int, arg) -> int:
    col, _, _ = _arch()
    return _syscall(ctypes.c_long(_nr("seccomp", col)), ctypes.c_long(op),
                    ctypes.c_long(flags), arg)


def _kill_action() -> int:
    """KILL_PROCESS if the kernel knows it (Linux >= 4.14), else KILL_THREAD."""
    action = ctypes.c_uint32(SECCOMP_RET_KILL_PROCESS)
    if _seccomp(SECCOMP_GET_ACTION_AVAIL, 0, ctypes.byref(action)) == 0:
        return SECCOMP_RET_KILL_PROCESS
    return SECCOMP_RET_KILL_THREAD


# --------------------------------------------------------------------------------------
# Public API

def apply_rlimits(address_space_bytes: int | None, cpu_seconds: int | None,
                  open_files: int | None, file_size_bytes: int | None = 0) -> None:
    """Set RLIMIT_AS, RLIMIT_CPU (soft n, hard n + 1), RLIMIT_NOFILE, RLIMIT_FSIZE and
    RLIMIT_CORE = 0.  None leaves a limit unchanged.  A requested hard limit above the
    current one is clamped to it (lowering needs no privilege; raising would)."""

    def setl(res: int, soft: int, hard: int, name: str) -> None:
        _, cur_hard = resource.getrlimit(res)
        if cur_hard != resource.RLIM_INFINITY:
            hard = min(hard, cur_hard)
            soft = min(soft, hard)
        try:
            resource.setrlimit(res, (soft, hard))
        except (ValueError, OSError) as e:
            raise SandboxError(f"setrlimit({name}, {soft}, {hard}) failed: {e}") from e

    for value, name in ((address_space_bytes, "address_space_bytes"),
                        (cpu_seconds, "cpu_seconds"), (open_files, "open_files"),
                        (file_size_bytes, "file_size_bytes")):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise SandboxError(f"{name} must be a non-negative int or None, got {value!r}")
    if address_space_bytes is not None:
        setl(resource.RLIMIT_AS, address_space_bytes, address_space_bytes, "RLIMIT_AS")
    if cpu_seconds is not None:
        # SIGXCPU at the soft limit, SIGKILL at the hard limit one second later.
        setl(resource.RLIMIT_CPU, max(cpu_seconds, 1), max(cpu_seconds, 1) + 1, "RLIMIT_CPU")
    if open_files is not None:
        setl(resource.RLIMIT_NOFILE, open_files, open_files, "RLIMIT_NOFILE")
    if file_size_bytes is not None:
        setl(resource.RLIMIT_FSIZE, file_size_bytes, file_size_bytes, "RLIMIT_FSIZE")
    setl(resource.RLIMIT_CORE, 0, 0, "RLIMIT_CORE")
    setl(resource.RLIMIT_NICE, 0, 0, "RLIMIT_NICE")      # no way back from the worker's nice 19


def drop_capabilities() -> None:
    """Clear the effective, permitted and inheritable capability sets of the calling
    thread (and so the ambient set).  Matters when the worker runs as root: without
    capabilities it cannot raise hard rlimits, use real-time scheduling, etc."""
    _need_libc()
    col, _, _ = _arch()
    hdr = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if _syscall(ctypes.c_long(_nr("capset", col)), ctypes.byref(hdr), ctypes.byref(data)) != 0:
        raise _oserror("capset (dropping capabilities)")


def install_seccomp(own_pid: int | None = None) -> None:
    """PR_SET_NO_NEW_PRIVS, then install the filter on every thread (TSYNC).

    ``own_pid``: the only process this one may signal (default: os.getpid()).
    Irreversible; raises SandboxError if anything fails."""
    _need_libc()
    _arch()
    if own_pid is None:
        own_pid = os.getpid()
    code = build_filter(own_pid, kill_action=_kill_action())
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))

    if _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise _oserror("prctl(PR_SET_NO_NEW_PRIVS)")
    rc = _seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(prog))
    if rc < 0:
        raise _oserror("seccomp(SECCOMP_SET_MODE_FILTER, TSYNC)")
    if rc > 0:
        raise SandboxError(f"seccomp TSYNC: thread {rc} could not be synchronised; "
                           "filter not installed")


def _close_fds(keep_fds: set[int]) -> None:
    keep = {int(fd) for fd in keep_fds}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        names = None
    if names is not None:
        for name in names:
            fd = int(name)
            if fd in keep:
                continue
            try:
                os.close(fd)
            except OSError:        # the listdir's own fd, already closed
                pass
        return
    # No /proc: close ranges between the kept fds (close_range(2) where available).
    hi = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hi == resource.RLIM_INFINITY or hi > (1 << 20):
        hi = 1 << 20
    lo = 0
    for fd in sorted(k for k in keep if k >= 0):
        os.closerange(lo, fd)
        lo = fd + 1
    os.closerange(lo, hi)


def drop_identity(uid: int, gid: int) -> None:
    """Become ``uid``/``gid`` for good: no supplementary groups, real = effective =
    saved ids (needs root; afterwards every capability is gone too)."""
    for v, name in ((uid, "uid"), (gid, "gid")):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 < v < (1 << 32) - 1:
            raise SandboxError(f"{name} must be an unprivileged id (1 .. 2^32-2), got {v!r}")
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as e:
        raise SandboxError(f"cannot switch to uid {uid} / gid {gid}: {e}") from e
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        raise SandboxError(f"identity switch to {uid}/{gid} did not stick")


def die_with_parent(parent_pid: int) -> None:
    """PR_SET_PDEATHSIG(SIGKILL), then make sure the parent is still ``parent_pid``.

    Must come *after* any uid change: the kernel clears the setting on one."""
    _need_libc()
    if _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise _oserror("prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent_pid:
        raise SandboxError("the parent died before the worker was set up")


def lockdown(*, own_pid: int, keep_fds: set[int], address_space_bytes: int | None,
             cpu_seconds: int | None, open_files: int | None,
             file_size_bytes: int | None = 0, drop_caps: bool = True,
             uid: int | None = None, gid: int | None = None, max_threads: int | None = None,
             parent_pid: int | None = None) -> None:
    """Lock the calling process down before running untrusted code.

    In this order: close all fds except ``keep_fds``; rlimits (``max_threads`` sets
    RLIMIT_NPROC, which binds once the process is not root); switch to ``uid`` /
    ``gid`` if given (``drop_identity``); die with ``parent_pid`` if given
    (``die_with_parent``); drop capabilities; install the seccomp allow list (see the
    module docstring).  Raises SandboxError on any failure; the caller must then exit
    without running user code."""
    try:
        _need_libc()
        _arch()
        if not isinstance(own_pid, int) or own_pid <= 0:
            raise SandboxError(f"own_pid must be a positive pid, got {own_pid!r}")
        if (uid is None) != (gid is None):
            raise SandboxError("uid and gid go together")
        if max_threads is not None and (not isinstance(max_threads, int) or max_threads < 1):
            raise SandboxError(f"max_threads must be a positive int, got {max_threads!r}")
        _close_fds(set(keep_fds))
        if file_size_bytes is not None and threading.current_thread() is threading.main_thread():
            # Writing past RLIMIT_FSIZE then fails with EFBIG instead of killing us.
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        apply_rlimits(address_space_bytes, cpu_seconds, open_files, file_size_bytes)
        if max_threads is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (max_threads, max_threads))
        if uid is not None:
            drop_identity(uid, gid)
        if parent_pid is not None:
            die_with_parent(parent_pid)
        if drop_caps:
            drop_capabilities()
        install_seccomp(own_pid)
    except SandboxError:
        raise
    except Exception as e:  # noqa: BLE001 - anything else is a setup failure too
        raise SandboxError(f"lockdown failed: {type(e).__name__}: {e}") from e
