"""The zygote: a small process that has already imported the LIP library, the
tokenizer and a set of standard modules, and forks one worker per LIP.

    kernel <--AF_UNIX SOCK_SEQPACKET socketpair--> zygote --fork--> worker (sandboxed)
             commands + fds (SCM_RIGHTS) / reports

Commands (kernel -> zygote), one message each: ``{"cmd": "spawn", "lip": id,
"names": {...}, "uid": int|null, "gid": int|null, "limits": {...}, "threads": n}``
with two file descriptors: a memfd holding the program (orjson ``{"source",
"filename", "args"}``) and the LIP's own doorbell (an eventfd); ``{"cmd": "exit"}``.
Reports (zygote -> kernel): ``{"ready": pid}``, ``{"spawned": id, "pid": pid}``,
``{"exited": id, "pid": pid, "status": code, "signal": sig}``.

The zygote never holds user data: it forks, closes its copies of both fds at
once and never reads the memfd, so no LIP can find another's program or
arguments in the memory it inherits.  It is started as a fresh interpreter
(never forked from the kernel, which holds torch and its thread pools), with a
clean minimal environment (never the kernel's), BLAS and tokenizer parallelism
off so that forking is safe, and PR_SET_PDEATHSIG(SIGKILL) so it dies with the
kernel; when its channel closes it kills its workers.

Each worker runs in a process group of its own but in the kernel's session,
at the zygote's nice value (--lip-nice): a busy one is reniced by the kernel
(cpu.py), so LIPs get only the CPU the forward pass leaves.

A worker, before any user code: replaces fds 0-2 with /dev/null (so it can
never write the zygote's channel), reads and closes its program memfd,
attaches its shared-memory ring (opening the kernel's 0600 objects while still
root), routes print() and tracebacks through the ring, sets a minimal
``os.environ``, and calls `sandbox.lockdown`: close every other fd, rlimits
(RLIMIT_NPROC = the thread cap), drop to the LIP's own uid/gid,
PR_SET_PDEATHSIG(SIGKILL) (it dies with the zygote, so with the kernel), drop
capabilities, seccomp allow list.  Then it compiles the program and calls its
``main(*args)``.
"""
from __future__ import annotations

import os

# What the kernel starts the zygote with (nothing else of the kernel's environment).
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONDONTWRITEBYTECODE": "1"}
# What a LIP sees as os.environ.
LIP_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/nonexistent"}
MAX_PROGRAM = 64 << 20          # the kernel caps the source at 4 MiB; args add a little
PR_SET_PDEATHSIG = 1

for _k, _v in BASE_ENV.items():                     # parallelism off: forking must be safe
    if _k.endswith("_THREADS") or _k == "TOKENIZERS_PARALLELISM":
        os.environ[_k] = _v
    else:
        os.environ.setdefault(_k, _v)

import errno  # noqa: E402
import io  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import orjson  # noqa: E402

from symphony.kernel import heap  # noqa: E402

# Modules a LIP may import (no file system access after the sandbox is on).
PRELOAD = ["json", "re", "math", "cmath", "random", "itertools", "functools", "collections",
           "collections.abc", "dataclasses", "typing", "time", "string", "heapq", "bisect",
           "statistics", "concurrent.futures", "concurrent.futures.thread", "threading", "queue", "textwrap", "enum", "abc",
           "copy", "struct", "hashlib", "base64", "datetime", "decimal", "fractions", "operator",
           "contextlib", "io", "traceback", "difflib", "fnmatch", "html", "urllib.parse", "uuid",
           "secrets", "unicodedata", "encodings.idna", "argparse", "gettext", "locale", "shutil", "ast", "numpy",
           "numpy.random", "numpy.linalg", "numpy.ma", "orjson", "symphony.lip", "symphony.ipc.lip_side",
           "symphony.kernel.workers.sandbox.lockdown", "symphony.tokenizer",
           # the LIP standard library and the libraries stock programs use
           "symphony.lip.sampling", "symphony.lip.helpers", "llguidance", "llguidance.numpy",
           "symphony.lip.streaming", "symphony.lip.decoding", "symphony.lip.grammar", "symphony.lip.tools",
           "symphony.lip.prefixcache", "symphony.lip.serving", "symphony.lip.agents"]


class _RingStream(io.TextIOBase):
    """sys.stdout / sys.stderr of a LIP: lines go to the user through the kernel."""

    def __init__(self, name: str):
        self.name, self._buf = name, ""

    def writable(self):
        return True

    def write(self, s: str) -> int:
        self._buf += s
        if "\n" in self._buf or len(self._buf) > 4096:
            self.flush()
        return len(s)

    def flush(self):
        if self._buf:
            from symphony.lip import runtime
            text, self._buf = self._buf, ""
            try:
                runtime.write_stream(self.name, text)
            except Exception:
                pass


def _read_program(fd: int) -> dict:
    """The worker's program from its memfd: {"source": str, "filename": str, "args": [str]}."""
    chunks, off = [], 0
    while True:
        b = os.pread(fd, 1 << 20, off)
        if not b:
            break
        chunks.append(b)
        off += len(b)
        if off > MAX_PROGRAM:
            raise ValueError("program too large")
    os.close(fd)
    prog = orjson.loads(b"".join(chunks))
    if not (isinstance(prog, dict) and isinstance(prog.get("source"), str)
            and isinstance(prog.get("filename"), str) and isinstance(prog.get("args"), list)
            and all(isinstance(a, str) for a in prog["args"])):
        raise ValueError("malformed program message")
    return prog


def _worker(msg: dict, prog_fd: int, bell_fd: int, tok, zygote_pid: int) -> None:
    """In the forked child: read the program, lock down, run the LIP.  Never returns."""
    code = 70
    try:
        os.setpgid(0, 0)                # out of the kernel's process group (terminal signals), but in its
                                        # session: no CPU scheduling group (autogroup) of its own (cpu.py)
        devnull = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        from symphony.kernel.workers.sandbox.lockdown import lockdown
        from symphony.ipc.lip_side import LipSide
        from symphony.lip import runtime
        prog = _read_program(prog_fd)
        ring = LipSide.attach(msg["names"], bell_fd)
        runtime.attach(ring, tok)
        sys.stdout, sys.stderr = _RingStream("stdout"), _RingStream("stderr")
        os.environ.clear()
        os.environ.update(LIP_ENV)
        lim = msg.get("limits", {})
        lockdown(own_pid=os.getpid(), keep_fds={0, 1, 2, bell_fd},
                 address_space_bytes=lim.get("memory_bytes"), cpu_seconds=lim.get("cpu_seconds"),
                 open_files=lim.get("open_files", 64), uid=msg.get("uid"), gid=msg.get("gid"),
                 max_threads=msg.get("threads"), parent_pid=zygote_pid)
    except BaseException:
        try:
            sys.stderr.write("symphony: LIP sandbox setup failed:\n" + traceback.format_exc())
            sys.stderr.flush()
        finally:
            os._exit(70)
    try:
        g = {"__name__": "__lip__", "__file__": prog["filename"], "__builtins__": __builtins__}
        exec(compile(prog["source"], prog["filename"], "exec"), g)
        main = g.get("main")
        if not callable(main):
            raise SystemExit(f"{prog['filename']}: a LIP must define main(*args)")
        rc = main(*prog["args"])
        code = rc if isinstance(rc, int) and not isinstance(rc, bool) and 0 <= rc < 256 else 0
    except SystemExit as e:
        if isinstance(e.code, int):
            code = e.code
        elif e.code is None:
            code = 0
        else:
            sys.stderr.write(f"{e.code}\n")
            code = 1
    except BaseException:
        sys.stderr.write(traceback.format_exc())
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _set_nice(nice: int) -> None:
    """The zygote's nice value, which its workers inherit (symphony-kernel
    --lip-nice, default 0); the kernel renices a busy one to 19 (cpu.py)."""
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except OSError:
            pass


def _close(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def main() -> None:
    import ctypes
    import importlib
    tok_file, chan_fd, kernel_pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    nice = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != kernel_pid:
        sys.exit("symphony zygote: the kernel is gone (or PR_SET_PDEATHSIG failed)")
    _set_nice(nice)
    chan = socket.socket(fileno=chan_fd)
    for m in PRELOAD:
        try:
            importlib.import_module(m)
        except ImportError as e:                        # LIPs that import it will fail clearly
            print(f"symphony zygote: cannot preload {m}: {e}", file=sys.stderr, flush=True)
    from symphony.tokenizer import Tokenizer
    with open(tok_file, encoding="utf-8") as f:
        tok = Tokenizer.from_json(f.read())
    if tok.chat_template:                                   # compile it (and import jinja2) now:
        try:                                                # workers cannot read module files
            tok.apply_chat_template([{"role": "user", "content": "x"}])
        except Exception:
            pass
    tok.decode(tok.encode("warm up"))
    try:                                                    # the grammar engine's view of the
        from symphony.lip import grammar                    # vocabulary, built once for all LIPs
        grammar.preload(tok)
    except Exception as e:
        print(f"symphony zygote: no llguidance tokenizer: {e}", file=sys.stderr, flush=True)
    rd, wr = os.pipe()
    os.set_blocking(wr, False)
    signal.set_wakeup_fd(wr)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)           # the kernel decides when we stop
    lips: dict[int, int] = {}                                # os pid -> lip id
    me = os.getpid()

    def report(obj):
        chan.sendall(orjson.dumps(obj))

    heap.settle("zygote")                   # its workers inherit the frozen heap (shared, never walked)
    report({"ready": me})
    try:
        while True:
            try:
                r, _, _ = select.select([chan, rd], [], [], 1.0)
            except InterruptedError:
                r = []
            if rd in r:
                try:
                    os.read(rd, 4096)
                except BlockingIOError:
                    pass
            while lips:                                      # reap finished workers
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                lip = lips.pop(pid, None)
                sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
                code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -sig
                report({"exited": lip, "pid": pid, "status": code, "signal": sig})
            if chan not in r:
                continue
            data, fds, flags, _ = socket.recv_fds(chan, 1 << 16, 4)
            if not data:
                break                                        # the kernel is gone
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                _close(fds)
                print("symphony zygote: truncated command dropped", file=sys.stderr, flush=True)
                continue
            msg = orjson.loads(data)
            if msg.get("cmd") == "spawn":
                if len(fds) != 2:
                    _close(fds)
                    report({"exited": msg.get("lip"), "pid": 0, "status": 70, "signal": 0})
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.SIG_DFL)
                    _worker(msg, fds[0], fds[1], tok, me)
                _close(fds)                                  # never read: the worker's alone
                lips[pid] = msg["lip"]
                report({"spawned": msg["lip"], "pid": pid})
            elif msg.get("cmd") == "exit":
                return
            else:
                _close(fds)
    finally:
        for pid in lips:                                     # never outlive the kernel
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
    except OSError as e:
        if e.errno not in (errno.EPIPE, errno.ECONNRESET):
            raise
