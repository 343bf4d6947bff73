"""The seccomp allow list's data: syscall numbers, what is allowed, the argument rules.

`symphony.kernel.workers.sandbox.lockdown` turns this into a BPF program (see its docstring for what
each rule means to a LIP).  The numbers are checked against the kernel headers by
tests/security/test_sandbox.py.
"""
from __future__ import annotations

import errno as _errno

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
