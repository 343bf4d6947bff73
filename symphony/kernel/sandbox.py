"""Process lockdown for LIP workers: fd cleanup, rlimits, capabilities, seccomp-bpf.

A LIP (user program) runs in its own process, forked from a zygote that has
already imported everything a LIP may use.  Before any user code runs, the
worker calls ::

    lockdown(own_pid=os.getpid(), keep_fds={0, 1, 2, ...},
             address_space_bytes=..., cpu_seconds=..., open_files=...)

which, in this order,

1. closes every file descriptor not in ``keep_fds`` (walking /proc/self/fd,
   which still works at that point),
2. applies resource limits (``apply_rlimits``): RLIMIT_AS, RLIMIT_CPU
   (soft = n, hard = n + 1: SIGXCPU first, SIGKILL one second later),
   RLIMIT_NOFILE, RLIMIT_FSIZE = 0 (no file may grow; SIGXFSZ is ignored so
   such a write fails with EFBIG instead of killing the LIP) and RLIMIT_CORE = 0,
3. drops every Linux capability of the (single, freshly forked) thread, so a
   worker running as root cannot raise its hard limits or use CAP_SYS_* paths
   (skip with ``drop_caps=False``),
4. sets PR_SET_NO_NEW_PRIVS and installs a seccomp-bpf filter, built here with
   ``struct`` (no libseccomp), with SECCOMP_FILTER_FLAG_TSYNC so that every
   thread of the process gets it.  The filter can never be removed; it is
   inherited by every thread the LIP creates.

Any failure raises ``SandboxError``; the worker must then exit rather than run
user code.

Filter
------
First the architecture is checked: the filter is built for the running arch
(x86-64 or AArch64) and a syscall made through any other ABI (i386 ``int 0x80``
on x86-64, AArch32 compat on arm64, or x86-64's x32 numbers >= 0x40000000)
kills the whole process (SECCOMP_RET_KILL_PROCESS).  Then the syscall number
is compared against the table below; anything not listed is ALLOWED (pure
compute, memory management, futexes, threads, time, read/write on fds that are
already open, mmap, signals to oneself, ...).

=============================  ==============  ================================================
syscalls                       result          why
=============================  ==============  ================================================
open, openat, openat2, creat   EACCES          no file system access at all
open_by_handle_at,             EPERM           opening files by handle / probing handles
name_to_handle_at
socket, socketpair             EPERM           no network, no unix sockets (send/recv*,
                                               connect, bind, listen, accept(4) are denied
                                               too; without a socket fd they are moot)
connect, bind, listen,         EPERM           see above
accept, accept4
execve, execveat               EPERM           no other programs
fork, vfork                    EPERM           no child processes (fork bombs fail at once)
clone                          EPERM unless    threads only: flags must contain CLONE_THREAD
                               it is a thread  and no CLONE_NEW* namespace flag
clone3                         ENOSYS          flags live in memory, uninspectable; glibc
                                               then falls back to clone, which we inspect
ptrace, process_vm_readv,      EPERM           no access to other processes' memory
process_vm_writev, kcmp
kill, tkill, tgkill,           EPERM unless    a LIP may signal itself (target pid/tgid ==
rt_sigqueueinfo,               target is self  own_pid), never the kernel or another LIP
rt_tgsigqueueinfo
pidfd_open, pidfd_getfd,       EPERM           handles on other processes
pidfd_send_signal,
process_madvise,
process_mrelease
unlink, unlinkat, rename,      EPERM           no file system modification
renameat, renameat2, mkdir,
mkdirat, rmdir, link, linkat,
symlink, symlinkat, mknod,
mknodat, chmod, fchmod,
fchmodat, fchmodat2, chown,
fchown, fchownat, lchown,
utime, utimes, futimesat,
utimensat, setxattr,
lsetxattr, fsetxattr,
removexattr, lremovexattr,
fremovexattr, setxattrat,
removexattrat
truncate, ftruncate,           EPERM           shared-memory segments must not be resized
fallocate                                      by the LIP
chroot, pivot_root, mount,     EPERM           mounts and namespaces
umount2, open_tree, move_mount,
fsopen, fsconfig, fsmount,
fspick, mount_setattr,
open_tree_attr, unshare, setns
setuid, setgid, setreuid,      EPERM           identity and privilege changes
setregid, setresuid,
setresgid, setgroups,
setfsuid, setfsgid, capset
setrlimit                      EPERM           limits may not be changed ...
prlimit64                      EPERM if it     ... but may be read (new_limit == NULL)
                               sets a limit
setpriority,                   EPERM           no priority boosts / real-time scheduling;
sched_setparam,                                no renicing other processes
sched_setscheduler,
sched_setattr, ioprio_set
sched_setaffinity              EPERM unless    pinning other processes
                               pid is 0 / self
migrate_pages, move_pages      EPERM           moving other processes' memory
bpf, perf_event_open,          EPERM           large kernel attack surface, not needed
userfaultfd, io_uring_setup,
io_uring_enter,
io_uring_register, keyctl,
add_key, request_key,
modify_ldt (x86), personality,
iopl, ioperm (x86),
uselib, _sysctl (x86)
init_module, finit_module,     EPERM           system administration
delete_module, kexec_load,
kexec_file_load, reboot,
swapon, swapoff, quotactl,
quotactl_fd, acct,
settimeofday, clock_settime,
adjtimex, clock_adjtime,
sethostname, setdomainname,
syslog, vhangup,
lookup_dcookie
fanotify_init, inotify_init,   EPERM           watching the file system
inotify_init1
shmget, shmat, shmctl, shmdt,  EPERM           SysV IPC ids are global and guessable
semget, semop, semtimedop,
semctl, msgget, msgsnd,
msgrcv, msgctl
mq_open, mq_unlink             EPERM           POSIX message queues (global names)
ioctl                          EPERM if cmd    no injecting keystrokes into a terminal;
                               is TIOCSTI or   every other ioctl is allowed
                               TIOCLINUX
prctl                          EPERM if        rewriting the memory map's metadata;
                               PR_SET_MM       every other prctl is allowed
=============================  ==============  ================================================

Explicitly allowed (often asked about): threads (clone with CLONE_THREAD),
futex, mmap/mprotect/munmap/mremap/madvise (anonymous and of already-open fds),
memfd_create, read/write/sendto/recvfrom on already-open fds, pipe/pipe2,
eventfd, epoll, poll/select, nanosleep/clock_nanosleep, getrandom, stat-family
calls (no open), chdir/fchdir, prctl (except PR_SET_MM), seccomp and landlock
(stacking only restricts further).

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
* Threads are allowed (``threading``, ``concurrent.futures``, numpy's BLAS
  threads), within the CPU-time limit, which counts all threads together.
* Signals: only to yourself (``os.kill(os.getpid(), ...)``, ``signal.raise_signal``).
* Memory: bounded by RLIMIT_AS; exceeding it raises MemoryError.
* Reaching the CPU-time limit kills the process (SIGXCPU, then SIGKILL).
"""
from __future__ import annotations

import ctypes
import errno as _errno
import os
import resource
import signal
import struct
import threading

__all__ = ["SandboxError", "apply_rlimits", "drop_capabilities", "drop_identity", "die_with_parent",
           "install_seccomp", "lockdown", "build_filter", "SYSCALLS", "DENY_RULES"]


class SandboxError(Exception):
    """The sandbox could not be set up; the worker must not run user code."""


# --------------------------------------------------------------------------------------
# Constants (linux/seccomp.h, linux/filter.h, linux/audit.h, linux/sched.h, ...)

PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39
PR_SET_MM = 35
PR_SET_PDEATHSIG = 1

SECCOMP_MODE_FILTER = 2
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_GET_ACTION_AVAIL = 2
SECCOMP_FILTER_FLAG_TSYNC = 1

SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_KILL_THREAD = 0x00000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000

# classic BPF opcodes
BPF_LD_W_ABS = 0x00 | 0x00 | 0x20     # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x05 | 0x10 | 0x00        # BPF_JMP | BPF_JEQ | BPF_K
BPF_JGE_K = 0x05 | 0x30 | 0x00        # BPF_JMP | BPF_JGE | BPF_K
BPF_JSET_K = 0x05 | 0x40 | 0x00       # BPF_JMP | BPF_JSET | BPF_K
BPF_RET_K = 0x06 | 0x00               # BPF_RET | BPF_K
BPF_MAXINSNS = 4096

# struct seccomp_data { int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]; }
OFF_NR = 0
OFF_ARCH = 4


def _arg_lo(i: int) -> int:           # little-endian: low 32 bits of args[i]
    return 16 + 8 * i


def _arg_hi(i: int) -> int:
    return 16 + 8 * i + 4


CLONE_THREAD = 0x00010000
CLONE_NEW_MASK = (0x00020000      # CLONE_NEWNS
                  | 0x02000000    # CLONE_NEWCGROUP
                  | 0x04000000    # CLONE_NEWUTS
                  | 0x08000000    # CLONE_NEWIPC
                  | 0x10000000    # CLONE_NEWUSER
                  | 0x20000000    # CLONE_NEWPID
                  | 0x40000000)   # CLONE_NEWNET
TIOCSTI = 0x5412
TIOCLINUX = 0x541C

_LINUX_CAPABILITY_VERSION_3 = 0x20080522

# --------------------------------------------------------------------------------------
# Syscall numbers: name -> (x86_64, aarch64); None where the arch has no such call.
# (x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64: asm-generic/unistd.h.)

SYSCALLS: dict[str, tuple[int | None, int | None]] = {
    # hot path (allowed early, before the deny table)
    "read": (0, 63), "write": (1, 64), "close": (3, 57), "mmap": (9, 222),
    "mprotect": (10, 226), "munmap": (11, 215), "brk": (12, 214),
    "rt_sigprocmask": (14, 135), "sched_yield": (24, 124), "madvise": (28, 233),
    "futex": (202, 98), "clock_gettime": (228, 113), "clock_nanosleep": (230, 115),
    "getpid": (39, 172), "gettid": (186, 178), "lseek": (8, 62),
    # syscalls needed by install_seccomp itself
    "prctl": (157, 167), "seccomp": (317, 277), "capset": (126, 91), "capget": (125, 90),
    # files
    "open": (2, None), "creat": (85, None), "openat": (257, 56), "openat2": (437, 437),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "unlink": (87, None), "unlinkat": (263, 35), "rename": (82, None),
    "renameat": (264, 38), "renameat2": (316, 276), "mkdir": (83, None),
    "mkdirat": (258, 34), "rmdir": (84, None), "link": (86, None), "linkat": (265, 37),
    "symlink": (88, None), "symlinkat": (266, 36), "mknod": (133, None),
    "mknodat": (259, 33), "chmod": (90, None), "fchmod": (91, 52), "fchmodat": (268, 53),
    "fchmodat2": (452, 452), "chown": (92, None), "fchown": (93, 55),
    "fchownat": (260, 54), "lchown": (94, None), "utime": (132, None),
    "utimes": (235, None), "futimesat": (261, None), "utimensat": (280, 88),
    "setxattr": (188, 5), "lsetxattr": (189, 6), "fsetxattr": (190, 7),
    "removexattr": (197, 14), "lremovexattr": (198, 15), "fremovexattr": (199, 16),
    "setxattrat": (463, 463), "removexattrat": (466, 466),
    "truncate": (76, 45), "ftruncate": (77, 46), "fallocate": (285, 47),
    "fanotify_init": (300, 262), "inotify_init": (253, None), "inotify_init1": (294, 26),
    # mounts, namespaces
    "chroot": (161, 51), "pivot_root": (155, 41), "mount": (165, 40), "umount2": (166, 39),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "open_tree_attr": (467, 467),
    "unshare": (272, 97), "setns": (308, 268),
    # network
    "socket": (41, 198), "socketpair": (53, 199), "connect": (42, 203), "bind": (49, 200),
    "listen": (50, 201), "accept": (43, 202), "accept4": (288, 242),
    # processes
    "execve": (59, 221), "execveat": (322, 281), "fork": (57, None), "vfork": (58, None),
    "clone": (56, 220), "clone3": (435, 435),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "kcmp": (312, 272), "pidfd_open": (434, 434), "pidfd_getfd": (438, 438),
    "pidfd_send_signal": (424, 424), "process_madvise": (440, 440),
    "process_mrelease": (448, 448),
    "kill": (62, 129), "tkill": (200, 130), "tgkill": (234, 131),
    "rt_sigqueueinfo": (129, 138), "rt_tgsigqueueinfo": (297, 240),
    # identity
    "setuid": (105, 146), "setgid": (106, 144), "setreuid": (113, 145),
    "setregid": (114, 143), "setresuid": (117, 147), "setresgid": (119, 149),
    "setgroups": (116, 159), "setfsuid": (122, 151), "setfsgid": (123, 152),
    # limits, scheduling
    "setrlimit": (160, 164), "prlimit64": (302, 261), "setpriority": (141, 140),
    "sched_setparam": (142, 118), "sched_setscheduler": (144, 119),
    "sched_setattr": (314, 274), "sched_setaffinity": (203, 122), "ioprio_set": (251, 30),
    "migrate_pages": (256, 238), "move_pages": (279, 239),
    # kernel attack surface
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427), "keyctl": (250, 219), "add_key": (248, 217),
    "request_key": (249, 218), "modify_ldt": (154, None), "personality": (135, 92),
    "iopl": (172, None), "ioperm": (173, None), "uselib": (134, None), "_sysctl": (156, None),
    # administration
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "reboot": (169, 142),
    "swapon": (167, 224), "swapoff": (168, 225), "quotactl": (179, 60),
    "quotactl_fd": (443, 443), "acct": (163, 89), "settimeofday": (164, 170),
    "clock_settime": (227, 112), "adjtimex": (159, 171), "clock_adjtime": (305, 266),
    "sethostname": (170, 161), "setdomainname": (171, 162), "syslog": (103, 116),
    "vhangup": (153, 58), "lookup_dcookie": (212, 18),
    # SysV IPC, POSIX mqueues
    "shmget": (29, 194), "shmat": (30, 196), "shmctl": (31, 195), "shmdt": (67, 197),
    "semget": (64, 190), "semop": (65, 193), "semtimedop": (220, 192), "semctl": (66, 191),
    "msgget": (68, 186), "msgsnd": (69, 189), "msgrcv": (70, 188), "msgctl": (71, 187),
    "mq_open": (240, 180), "mq_unlink": (241, 181),
    # conditional
    "ioctl": (16, 29),
}

_HOT = ("read", "write", "futex", "mmap", "munmap", "mprotect", "madvise", "brk", "close",
        "rt_sigprocmask", "sched_yield", "clock_gettime", "clock_nanosleep", "getpid",
        "gettid", "lseek")

_EPERM = _errno.EPERM
_EACCES = _errno.EACCES
_ENOSYS = _errno.ENOSYS

# (syscall names, rule).  Rules:
#   ("errno", E)                         always fail with E
#   ("thread_clone",)                    allow clone only for threads (see _clone_block)
#   ("arg_in", i, values, E)             allow if low 32 bits of args[i] in values, else E
#                                        (values may contain "self" = own_pid)
#   ("arg_not_in", i, values, E)         fail with E if low 32 bits of args[i] in values
#   ("arg_null", i, E)                   allow if args[i] (all 64 bits) == 0, else E
DENY_RULES: list[tuple[tuple[str, ...], tuple]] = [
    (("open", "openat", "openat2", "creat"), ("errno", _EACCES)),
    (("open_by_handle_at", "name_to_handle_at"), ("errno", _EPERM)),
    (("socket", "socketpair", "connect", "bind", "listen", "accept", "accept4"),
     ("errno", _EPERM)),
    (("execve", "execveat", "fork", "vfork"), ("errno", _EPERM)),
    (("clone",), ("thread_clone",)),
    (("clone3",), ("errno", _ENOSYS)),
    (("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_open",
      "pidfd_getfd", "pidfd_send_signal", "process_madvise", "process_mrelease"),
     ("errno", _EPERM)),
    (("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"),
     ("arg_in", 0, ("self",), _EPERM)),
    (("unlink", "unlinkat", "rename", "renameat", "renameat2", "mkdir", "mkdirat", "rmdir",
      "link", "linkat", "symlink", "symlinkat", "mknod", "mknodat", "chmod", "fchmod",
      "fchmodat", "fchmodat2", "chown", "fchown", "fchownat", "lchown", "utime", "utimes",
      "futimesat", "utimensat", "setxattr", "lsetxattr", "fsetxattr", "removexattr",
      "lremovexattr", "fremovexattr", "setxattrat", "removexattrat",
      "truncate", "ftruncate", "fallocate"), ("errno", _EPERM)),
    (("chroot", "pivot_root", "mount", "umount2", "open_tree", "move_mount", "fsopen",
      "fsconfig", "fsmount", "fspick", "mount_setattr", "open_tree_attr", "unshare",
      "setns"), ("errno", _EPERM)),
    (("setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups",
      "setfsuid", "setfsgid", "capset"), ("errno", _EPERM)),
    (("setrlimit",), ("errno", _EPERM)),
    (("prlimit64",), ("arg_null", 2, _EPERM)),
    (("setpriority", "sched_setparam", "sched_setscheduler", "sched_setattr", "ioprio_set",
      "migrate_pages", "move_pages"), ("errno", _EPERM)),
    (("sched_setaffinity",), ("arg_in", 0, (0, "self"), _EPERM)),
    (("bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
      "io_uring_register", "keyctl", "add_key", "request_key", "modify_ldt", "personality",
      "iopl", "ioperm", "uselib", "_sysctl"), ("errno", _EPERM)),
    (("init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
      "reboot", "swapon", "swapoff", "quotactl", "quotactl_fd", "acct", "settimeofday",
      "clock_settime", "adjtimex", "clock_adjtime", "sethostname", "setdomainname",
      "syslog", "vhangup", "lookup_dcookie"), ("errno", _EPERM)),
    (("fanotify_init", "inotify_init", "inotify_init1"), ("errno", _EPERM)),
    (("shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semtimedop", "semctl",
      "msgget", "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink"), ("errno", _EPERM)),
    (("ioctl",), ("arg_not_in", 1, (TIOCSTI, TIOCLINUX), _EPERM)),
    (("prctl",), ("arg_not_in", 0, (PR_SET_MM,), _EPERM)),
]

_ARCHES = {"x86_64": (0, AUDIT_ARCH_X86_64), "amd64": (0, AUDIT_ARCH_X86_64),
           "aarch64": (1, AUDIT_ARCH_AARCH64), "arm64": (1, AUDIT_ARCH_AARCH64)}


def _arch() -> tuple[int, int, str]:
    machine = os.uname().machine
    if machine not in _ARCHES:
        raise SandboxError(f"seccomp sandbox: unsupported architecture {machine!r} "
                           "(only x86_64 and aarch64 are supported)")
    col, audit = _ARCHES[machine]
    return col, audit, machine


def _nr(name: str, col: int) -> int | None:
    return SYSCALLS[name][col]


# --------------------------------------------------------------------------------------
# BPF program

def _insn(code: int, k: int = 0, jt: int = 0, jf: int = 0) -> tuple[int, int, int, int]:
    if not (0 <= jt <= 255 and 0 <= jf <= 255):
        raise SandboxError(f"BPF jump out of range ({jt}, {jf})")
    return (code, jt, jf, k & 0xFFFFFFFF)


def _ret(action: int):
    return _insn(BPF_RET_K, action)


def _errno_action(e: int) -> int:
    return SECCOMP_RET_ERRNO | (e & 0xFFFF)


def _rule_block(rule: tuple, own_pid: int) -> list:
    """Instructions that decide a syscall already known to match; always return."""
    kind = rule[0]
    if kind == "errno":
        return [_ret(_errno_action(rule[1]))]
    if kind == "thread_clone":
        return [
            _insn(BPF_LD_W_ABS, _arg_lo(0)),
            _insn(BPF_JSET_K, CLONE_THREAD, jt=0, jf=2),    # no CLONE_THREAD -> EPERM
            _insn(BPF_JSET_K, CLONE_NEW_MASK, jt=1, jf=0),  # a namespace flag -> EPERM
            _ret(SECCOMP_RET_ALLOW),
            _ret(_errno_action(_EPERM)),
        ]
    if kind in ("arg_in", "arg_not_in"):
        _, i, values, e = rule
        vals = [own_pid if v == "self" else int(v) for v in values]
        vals = list(dict.fromkeys(vals))
        match_ret = SECCOMP_RET_ALLOW if kind == "arg_in" else _errno_action(e)
        miss_ret = _errno_action(e) if kind == "arg_in" else SECCOMP_RET_ALLOW
        n = len(vals)
        block = [_insn(BPF_LD_W_ABS, _arg_lo(i))]
        for j, v in enumerate(vals):
            # on match jump to the "match" return, which sits after the miss return
            block.append(_insn(BPF_JEQ_K, v, jt=(n - j - 1) + 1, jf=0))
        block.append(_ret(miss_ret))
        block.append(_ret(match_ret))
        return block
    if kind == "arg_null":
        _, i, e = rule
        return [
            _insn(BPF_LD_W_ABS, _arg_lo(i)),
            _insn(BPF_JEQ_K, 0, jt=0, jf=2),
            _insn(BPF_LD_W_ABS, _arg_hi(i)),
            _insn(BPF_JEQ_K, 0, jt=1, jf=0),
            _ret(_errno_action(e)),
            _ret(SECCOMP_RET_ALLOW),
        ]
    raise SandboxError(f"unknown seccomp rule {rule!r}")


def build_filter(own_pid: int, machine: str | None = None,
                 kill_action: int = SECCOMP_RET_KILL_PROCESS) -> bytes:
    """The seccomp-bpf program (packed ``struct sock_filter`` array) for this arch."""
    if machine is None:
        col, audit, machine = _arch()
    elif machine in _ARCHES:
        col, audit = _ARCHES[machine]
    else:
        raise SandboxError(f"unsupported architecture {machine!r}")
    if not isinstance(own_pid, int) or own_pid <= 0:
        raise SandboxError(f"own_pid must be a positive pid, got {own_pid!r}")

    prog = [
        _insn(BPF_LD_W_ABS, OFF_ARCH),
        _insn(BPF_JEQ_K, audit, jt=1, jf=0),
        _ret(kill_action),                       # foreign ABI (i386, arm32): kill
        _insn(BPF_LD_W_ABS, OFF_NR),
    ]
    if audit == AUDIT_ARCH_X86_64:
        prog += [_insn(BPF_JGE_K, X32_SYSCALL_BIT, jt=0, jf=1), _ret(kill_action)]
    # Hot, always-allowed syscalls first: keeps the common path short.
    for name in _HOT:
        nr = _nr(name, col)
        if nr is not None:
            prog += [_insn(BPF_JEQ_K, nr, jt=0, jf=1), _ret(SECCOMP_RET_ALLOW)]
    seen: set[int] = set()
    for names, rule in DENY_RULES:
        block = _rule_block(rule, own_pid)
        for name in names:
            nr = _nr(name, col)
            if nr is None:
                continue
            if nr in seen:
                raise SandboxError(f"syscall {name} ({nr}) listed twice")
            seen.add(nr)
            # A block always returns, and never reloads nr; so each test is
            # "JEQ nr ? fall into block : skip over it".
            prog.append(_insn(BPF_JEQ_K, nr, jt=0, jf=len(block)))
            prog.extend(block)
    prog.append(_ret(SECCOMP_RET_ALLOW))
    if len(prog) > BPF_MAXINSNS:
        raise SandboxError(f"BPF program too long ({len(prog)} instructions)")
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


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
