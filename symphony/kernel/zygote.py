"""The zygote: a small process that has already imported the LIP library, the
tokenizer and a set of standard modules, and forks one worker per LIP.

    kernel --stdin: JSON lines--> zygote --fork--> worker (sandboxed) runs lip.py
           <--stdout: JSON lines--

Commands (kernel -> zygote): ``{"cmd": "spawn", "lip": id, "names": {...},
"source": str, "filename": str, "args": [...], "limits": {...}}``.
Reports (zygote -> kernel): ``{"spawned": id, "pid": pid}``,
``{"exited": id, "pid": pid, "status": code, "signal": sig}``.

It is started as a fresh interpreter (never forked from the kernel, which
holds torch and its thread pools), with BLAS and tokenizer parallelism off so
that forking is safe.  A worker, before any user code: replaces fds 0-2 with
/dev/null (so it can never write the zygote's report pipe), attaches its
shared-memory ring, routes print() and tracebacks through the ring, closes
every other fd, sets rlimits and installs the seccomp filter
(`sandbox.lockdown`).  Then it compiles the LIP's source (sent by the kernel:
the worker cannot open files) and calls its ``main(*args)``.
"""
from __future__ import annotations

import os

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import errno  # noqa: E402
import io  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import orjson  # noqa: E402

# Modules a LIP may import (no file system access after the sandbox is on).
PRELOAD = ["json", "re", "math", "cmath", "random", "itertools", "functools", "collections",
           "collections.abc", "dataclasses", "typing", "time", "string", "heapq", "bisect",
           "statistics", "concurrent.futures", "concurrent.futures.thread", "threading", "queue", "textwrap", "enum", "abc",
           "copy", "struct", "hashlib", "base64", "datetime", "decimal", "fractions", "operator",
           "contextlib", "io", "traceback", "difflib", "fnmatch", "html", "urllib.parse", "uuid",
           "secrets", "unicodedata", "argparse", "gettext", "locale", "shutil", "ast", "numpy",
           "numpy.random", "numpy.linalg", "numpy.ma", "orjson", "symphony.lip", "symphony.kernel.shm",
           "symphony.kernel.sandbox", "symphony.kernel.tokenizer",
           # the LIP standard library and the libraries stock programs use
           "symphony.lip.sampling", "symphony.lip.helpers", "llguidance", "llguidance.numpy"]


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
                runtime._write_stream(self.name, text)
            except Exception:
                pass


def _worker(msg: dict, tok) -> None:
    """In the forked child: lock down, then run the LIP.  Never returns."""
    code = 70
    try:
        os.setsid()
        devnull = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        from symphony.kernel.sandbox import lockdown
        from symphony.kernel.shm import LipSide
        from symphony.lip import runtime
        ring = LipSide.attach(msg["names"])
        runtime._attach(ring, tok)
        sys.stdout, sys.stderr = _RingStream("stdout"), _RingStream("stderr")
        lim = msg.get("limits", {})
        lockdown(own_pid=os.getpid(), keep_fds={0, 1, 2},
                 address_space_bytes=lim.get("memory_bytes"), cpu_seconds=lim.get("cpu_seconds"),
                 open_files=lim.get("open_files", 64))
    except BaseException:
        try:
            sys.stderr.write("symphony: LIP sandbox setup failed:\n" + traceback.format_exc())
            sys.stderr.flush()
        finally:
            os._exit(70)
    try:
        g = {"__name__": "__lip__", "__file__": msg["filename"], "__builtins__": __builtins__}
        exec(compile(msg["source"], msg["filename"], "exec"), g)
        main = g.get("main")
        if not callable(main):
            raise SystemExit(f"{msg['filename']}: a LIP must define main(*args)")
        rc = main(*msg.get("args", []))
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


def main() -> None:
    import importlib
    tok_file = sys.argv[1]
    for m in PRELOAD:
        try:
            importlib.import_module(m)
        except ImportError as e:                        # LIPs that import it will fail clearly
            print(f"symphony zygote: cannot preload {m}: {e}", file=sys.stderr, flush=True)
    from symphony.kernel.tokenizer import Tokenizer
    with open(tok_file, encoding="utf-8") as f:
        tok = Tokenizer.from_json(f.read())
    if tok.chat_template:                                   # compile it (and import jinja2) now:
        try:                                                # workers cannot read module files
            tok.apply_chat_template([{"role": "user", "content": "x"}])
        except Exception:
            pass
    tok.decode(tok.encode("warm up"))
    try:                                                    # the grammar engine's view of the
        import llguidance                                   # vocabulary, built once for all LIPs
        from symphony.lip import runtime
        runtime.ll_tokenizer = llguidance.LLTokenizer(tok._tok.to_str(), n_vocab=tok.vocab_size,
                                                      eos_token=list(tok.eos_ids))
    except Exception as e:
        print(f"symphony zygote: no llguidance tokenizer: {e}", file=sys.stderr, flush=True)
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    rd, wr = os.pipe()
    os.set_blocking(wr, False)
    signal.set_wakeup_fd(wr)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)           # the kernel decides when we stop
    lips: dict[int, int] = {}                                # os pid -> lip id
    stdin = sys.stdin.buffer
    buf = b""

    def report(obj):
        out.write(orjson.dumps(obj) + b"\n")

    report({"ready": os.getpid()})
    while True:
        try:
            r, _, _ = select.select([stdin, rd], [], [], 1.0)
        except InterruptedError:
            r = []
        if rd in r:
            try:
                os.read(rd, 4096)
            except BlockingIOError:
                pass
        while lips:                                          # reap finished workers
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
        if stdin in r:
            chunk = os.read(stdin.fileno(), 1 << 20)
            if not chunk:
                break                                        # the kernel is gone
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = orjson.loads(line)
                if msg.get("cmd") == "spawn":
                    pid = os.fork()
                    if pid == 0:
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        signal.signal(signal.SIGINT, signal.SIG_DFL)
                        _worker(msg, tok)
                    lips[pid] = msg["lip"]
                    report({"spawned": msg["lip"], "pid": pid})
                elif msg.get("cmd") == "exit":
                    return


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise
