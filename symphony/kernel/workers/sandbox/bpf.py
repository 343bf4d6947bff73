"""The seccomp-bpf filter: the allow list (seccomp_table.py) compiled to classic BPF.

`build_filter(own_pid)` returns the program that `lockdown.install_seccomp`
installs; the policy it encodes is the table in lockdown.py's docstring.
Pure computation (no system call), so it is tested on its own.

Program shape::

    load arch: a foreign ABI (i386, arm32) -> kill
    load nr:   x86-64's x32 numbers -> kill
               each hot syscall (`_HOT`) -> ALLOW
               each syscall of each rule (`RULES`) -> that rule's block, which
                   always returns (ALLOW, an errno, or argument checks)
               anything else -> EPERM
"""
from __future__ import annotations

import os
import struct

from symphony.kernel.workers.sandbox import SandboxError
from symphony.kernel.workers.sandbox.seccomp_table import (_EPERM, _HOT, ALLOW, AT_EMPTY_PATH, AT_FDCWD, F_SETFL, FCNTL_OK, O_ASYNC,
                            RULES, SYSCALLS)

__all__ = ["build_filter", "SYSCALLS", "ALLOW", "RULES"]

# --------------------------------------------------------------------------------------
# Constants (linux/seccomp.h, linux/filter.h, linux/audit.h, linux/sched.h, ...)

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

# --------------------------------------------------------------------------------------
# Architectures

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
