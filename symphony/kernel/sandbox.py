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
    "ioctl": (16, 29), "fcntl": (72, 25),
    # allowed, unconditionally or with argument checks (see ALLOW / RULES)
    "readv": (19, 65), "writev": (20, 66), "pread64": (17, 67), "pwrite64": (18, 68),
    "preadv": (295, 69), "pwritev": (296, 70), "preadv2": (327, 286), "pwritev2": (328, 287),
    "mremap": (25, 216), "msync": (26, 227), "mincore": (27, 232),
    "rt_sigaction": (13, 134), "rt_sigreturn": (15, 139), "rt_sigpending": (127, 136),
    "rt_sigtimedwait": (128, 137), "rt_sigsuspend": (130, 133), "sigaltstack": (131, 132),
    "set_robust_list": (273, 99), "get_robust_list": (274, 100), "set_tid_address": (218, 96),
    "rseq": (334, 293), "membarrier": (324, 283), "restart_syscall": (219, 128),
    "sched_getaffinity": (204, 123), "sched_getparam": (143, 121),
    "sched_getscheduler": (145, 120), "sched_get_priority_max": (146, 125),
    "sched_get_priority_min": (147, 126), "sched_getattr": (315, 275),
    "getppid": (110, 173), "getuid": (102, 174), "geteuid": (107, 175), "getgid": (104, 176),
    "getegid": (108, 177), "getresuid": (118, 148), "getresgid": (120, 150),
    "getgroups": (115, 158), "getpgid": (121, 155), "getpgrp": (111, None), "getsid": (124, 156),
    "clock_getres": (229, 114), "nanosleep": (35, 101), "gettimeofday": (96, 169),
    "time": (201, None), "exit": (60, 93), "exit_group": (231, 94), "getrandom": (318, 278),
    "uname": (63, 160), "getrusage": (98, 165), "times": (100, 153), "sysinfo": (99, 179),
    "getcpu": (309, 168), "getpriority": (140, 141), "getrlimit": (97, 163),
    "pipe": (22, None), "pipe2": (293, 59), "eventfd": (284, None), "eventfd2": (290, 19),
    "epoll_create": (213, None), "epoll_create1": (291, 20), "epoll_ctl": (233, 21),
    "epoll_wait": (232, None), "epoll_pwait": (281, 22), "epoll_pwait2": (441, 441),
    "poll": (7, None), "ppoll": (271, 73), "select": (23, None), "pselect6": (270, 72),
    "dup": (32, 23), "dup2": (33, None), "dup3": (292, 24),
    "fstat": (5, 80), "newfstatat": (262, 79), "getcwd": (79, 17),
    "getitimer": (36, 102), "setitimer": (38, 103), "alarm": (37, None),
    "timer_create": (222, 107), "timer_settime": (223, 110), "timer_gettime": (224, 108),
    "timer_delete": (226, 111), "timer_getoverrun": (225, 109),
    "timerfd_create": (283, 85), "timerfd_settime": (286, 86), "timerfd_gettime": (287, 87),
    "signalfd": (282, None), "signalfd4": (289, 74), "arch_prctl": (158, None),
    # refused with a specific errno (anything unlisted gets EPERM)
    "statx": (332, 291), "stat": (4, None), "lstat": (6, None), "readlink": (89, None),
    "readlinkat": (267, 78), "access": (21, None), "faccessat": (269, 48),
    "faccessat2": (439, 439), "pkey_mprotect": (329, 288),
    # refused by default (listed for the tests and the record)
    "memfd_create": (319, 279), "wait4": (61, 260), "waitid": (247, 95), "mlock": (149, 228),
    "mlockall": (151, 230), "splice": (275, 76), "tee": (276, 77), "vmsplice": (278, 75),
    "sendfile": (40, 71), "copy_file_range": (326, 285), "sendmsg": (46, 211),
    "recvmsg": (47, 212), "sendto": (44, 206), "recvfrom": (45, 207), "getsockopt": (55, 209),
    "setsockopt": (54, 208), "flock": (73, 32), "chdir": (80, 49), "fchdir": (81, 50),
    "getdents64": (217, 61), "umask": (95, 166), "fsync": (74, 82), "close_range": (436, 436),
}

# Allowed without looking at the arguments, beyond the hot ones.  Deliberately absent
# (so EPERM): every file-system path call but newfstatat (glibc's fstat; a path there
# is subject to the LIP's own uid), sockets and socket I/O, fork/exec, wait4, ptrace,
# identity and limit changes, memfd_create, mlock, splice & co, fsync, flock, umask,
# chdir, getdents, io_uring, bpf, namespaces, SysV / POSIX IPC, keyrings, ...
ALLOW = (
    "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2",
    "mremap", "msync", "mincore",
    "rt_sigaction", "rt_sigreturn", "rt_sigpending", "rt_sigtimedwait", "rt_sigsuspend",
    "sigaltstack", "set_robust_list", "get_robust_list", "set_tid_address", "rseq",
    "membarrier", "restart_syscall", "sched_getparam", "sched_getscheduler",
    "sched_get_priority_max", "sched_get_priority_min", "sched_getattr",
    "getppid", "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups",
    "getpgid", "getpgrp", "getsid", "clock_getres", "nanosleep", "gettimeofday", "time",
    "exit", "exit_group", "getrandom", "uname", "getrusage", "times", "sysinfo", "getcpu",
    "getpriority", "getrlimit", "capget",
    "pipe", "pipe2", "eventfd", "eventfd2", "epoll_create", "epoll_create1", "epoll_ctl",
    "epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll", "select", "pselect6",
    "dup", "dup2", "dup3", "fstat", "getcwd",
    "getitimer", "setitimer", "alarm", "timer_create", "timer_settime", "timer_gettime",
    "timer_delete", "timer_getoverrun", "timerfd_create", "timerfd_settime", "timerfd_gettime",
    "signalfd", "signalfd4", "arch_prctl",
)

_HOT = ("read", "write", "futex", "munmap", "madvise", "brk", "close",
        "rt_sigprocmask", "sched_yield", "clock_gettime", "clock_nanosleep", "getpid",
        "gettid", "lseek")

_EPERM = _errno.EPERM
_EACCES = _errno.EACCES
_ENOSYS = _errno.ENOSYS
_ENOTTY = _errno.ENOTTY
_EINVAL = _errno.EINVAL

PROT_EXEC = 0x4
AT_EMPTY_PATH = 0x1000
AT_FDCWD = -100
O_ASYNC = 0x2000
# fcntl commands a LIP may use (F_SETFL only without O_ASYNC).  Refused: F_SETOWN(_EX),
# F_SETSIG (signals to other processes), F_SETLEASE, F_NOTIFY, F_SETPIPE_SZ, locks.
F_DUPFD, F_GETFD, F_SETFD, F_GETFL, F_SETFL = 0, 1, 2, 3, 4
F_DUPFD_CLOEXEC, F_GETPIPE_SZ, F_GET_SEALS = 1030, 1032, 1034
FCNTL_OK = (F_DUPFD, F_GETFD, F_SETFD, F_GETFL, F_DUPFD_CLOEXEC, F_GETPIPE_SZ, F_GET_SEALS)
# ioctls a LIP may use; any other answers ENOTTY ("not a terminal": what isatty expects)
FIONREAD, FIONBIO, FIONCLEX, FIOCLEX = 0x541B, 0x5421, 0x5450, 0x5451
IOCTL_OK = (FIONREAD, FIONBIO, FIONCLEX, FIOCLEX)
# prctl options a LIP may use: names, dumpable / no_new_privs / seccomp / THP / timer-slack
# queries, the capability bounding-set query, naming anonymous mappings (glibc).
PR_SET_VMA = 0x53564D41
PRCTL_OK = (3, 15, 16, 21, 23, 30, 39, 42, PR_SET_VMA)

# (syscall names, rule).  Rules:
#   ("errno", E)                         always fail with E
#   ("thread_clone",)                    allow clone only for threads, without namespaces
#   ("arg_in", i, values, E)             allow if low 32 bits of args[i] in values, else E
#                                        (values may contain "self" = own_pid)
#   ("no_bits", i, mask, E)              allow unless args[i]'s low 32 bits share a bit with mask
#   ("fcntl",)                           FCNTL_OK, or F_SETFL without O_ASYNC; else EPERM
#   ("prlimit",)                         allow reading (new_limit NULL) own limits only
#   ("fstat_only", E)                    newfstatat as fstat: flags == AT_EMPTY_PATH and
#                                        dirfd != AT_FDCWD, else E
RULES: list[tuple[tuple[str, ...], tuple]] = [
    (("mmap", "mprotect"), ("no_bits", 2, PROT_EXEC, _EPERM)),   # no new executable memory
    (("open", "openat", "openat2", "creat"), ("errno", _EACCES)),
    (("stat", "lstat", "access", "faccessat", "faccessat2", "readlink", "readlinkat"),
     ("errno", _EACCES)),
    (("statx",), ("errno", _ENOSYS)),            # Rust's std then falls back to fstat
    (("newfstatat",), ("fstat_only", _EACCES)),  # glibc's fstat(fd): (fd, "", AT_EMPTY_PATH)
    (("clone",), ("thread_clone",)),
    (("clone3",), ("errno", _ENOSYS)),           # flags in memory: glibc falls back to clone
    (("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"),
     ("arg_in", 0, ("self",), _EPERM)),
    (("sched_getaffinity",), ("arg_in", 0, (0, "self"), _EPERM)),
    (("prlimit64",), ("prlimit",)),
    (("fcntl",), ("fcntl",)),
    (("ioctl",), ("arg_in", 1, IOCTL_OK, _ENOTTY)),
    (("prctl",), ("arg_in", 0, PRCTL_OK, _EPERM)),
] + [((name,), ("allow",)) for name in ALLOW]

# Kept for callers of the old name: the rules are now an allow list.
DENY_RULES = RULES

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
    if kind == "allow":
        return [_ret(SECCOMP_RET_ALLOW)]
    if kind == "no_bits":
        _, i, mask, e = rule
        return [
            _insn(BPF_LD_W_ABS, _arg_lo(i)),
            _insn(BPF_JSET_K, mask, jt=1, jf=0),
            _ret(SECCOMP_RET_ALLOW),
            _ret(_errno_action(e)),
        ]
    if kind == "fcntl":
        ok = list(FCNTL_OK)
        n = len(ok)
        block = [_insn(BPF_LD_W_ABS, _arg_lo(1)),
                 _insn(BPF_JEQ_K, F_SETFL, jt=n + 2, jf=0)]          # -> the F_SETFL check
        for j, v in enumerate(ok):
            block.append(_insn(BPF_JEQ_K, v, jt=n - j, jf=0))        # -> allow
        block.append(_ret(_errno_action(_EPERM)))
        block.append(_ret(SECCOMP_RET_ALLOW))
        block += [_insn(BPF_LD_W_ABS, _arg_lo(2)),                 # F_SETFL: no O_ASYNC
                  _insn(BPF_JSET_K, O_ASYNC, jt=1, jf=0),
                  _ret(SECCOMP_RET_ALLOW),
                  _ret(_errno_action(_EPERM))]
        return block
    if kind == "fstat_only":
        e = _errno_action(rule[1])
        return [
            _insn(BPF_LD_W_ABS, _arg_lo(3)),
            _insn(BPF_JEQ_K, AT_EMPTY_PATH, jt=0, jf=2),
            _insn(BPF_LD_W_ABS, _arg_lo(0)),
            _insn(BPF_JEQ_K, AT_FDCWD & 0xFFFFFFFF, jt=0, jf=1),
            _ret(e),
            _ret(SECCOMP_RET_ALLOW),
        ]
    if kind == "prlimit":
        return [
            _insn(BPF_LD_W_ABS, _arg_lo(0)),
            _insn(BPF_JEQ_K, 0, jt=1, jf=0),
            _insn(BPF_JEQ_K, own_pid, jt=0, jf=4),
            _insn(BPF_LD_W_ABS, _arg_lo(2)),
            _insn(BPF_JEQ_K, 0, jt=0, jf=2),
            _insn(BPF_LD_W_ABS, _arg_hi(2)),
            _insn(BPF_JEQ_K, 0, jt=1, jf=0),
            _ret(_errno_action(_EPERM)),
            _ret(SECCOMP_RET_ALLOW),
        ]
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
    for names, rule in RULES:
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
    prog.append(_ret(_errno_action(_EPERM)))     # default: refuse
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
