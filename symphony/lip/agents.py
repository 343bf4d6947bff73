"""Building blocks of tool-using agents (the stock ReAct and SWARM programs use them).

* `Writer(f, tok, text)`: one KV file and the tokens not yet fed to it; greedy text up
  to a stop character (`until`), forced text (`write`), and a constrained choice among
  fixed openings (`choose`, a token mask per step), each counting the tokens it feeds;
* `run_tool(tools, name, arg)`: a tool's result, or its error, as one short line;
* tools that run on the server through the LIP's capabilities: `search_files`
  (the files under the directories granted with ``--grant read:DIR``) and `http_get`
  (hosts granted with ``--grant http:HOST[:PORT]``); and `calc`, arithmetic evaluated
  over the `ast` (never `eval`), in the LIP.
"""
from __future__ import annotations

import ast
import operator
from typing import Sequence

from .errors import SyscallError
from .runtime import KVFile, http, info, list_dir, pred, read_file

__all__ = ["Writer", "calc", "http_get", "run_tool", "search_files"]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64
MAX_FILES = 200             # files `search_files` reads at most


def calc(expr: str) -> str:
    """Arithmetic on numbers only: + - * / // % ** and parentheses (ValueError or
    SyntaxError otherwise; exponents above 64 are refused)."""
    def ev(n):
        if isinstance(n, ast.Constant) and type(n.value) in (int, float):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            a, b = ev(n.left), ev(n.right)
            if isinstance(n.op, ast.Pow) and abs(b) > MAX_EXPONENT:
                raise ValueError("exponent too large")
            return _OPS[type(n.op)](a, b)
        if isinstance(n, ast.UnaryOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.operand))
        raise ValueError("not arithmetic")
    expr = expr.replace("^", "**").replace("×", "*").replace("÷", "/").replace(",", "").rstrip("= ")
    v = ev(ast.parse(expr, mode="eval").body)
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def search_files(term: str, hits: int = 3) -> str:
    """The lines of the granted files (``--grant read:DIR``, read through the
    kernel) that contain the most words of ``term``, best first, as one line."""
    words = [w for w in term.lower().replace('"', " ").split() if len(w) > 2] or [term.lower()]
    found, todo, seen = [], list(info()["grants"].get("read", [])), 0
    while todo and seen < MAX_FILES:
        path = todo.pop(0)
        for name in list_dir(path):
            full = path.rstrip("/") + "/" + name
            if name.endswith("/"):
                todo.append(full)
                continue
            seen += 1
            for line in read_file(full, max_bytes=1 << 16).splitlines():
                score = sum(w in line.lower() for w in words)
                if score:
                    found.append((-score, f"{name}: {line.strip()}"))
    return "; ".join(h for _, h in sorted(found)[:hits]) or f"no file mentions {term}"


def http_get(url: str, max_chars: int = 300) -> str:
    """GET ``url`` through the kernel (a host granted with ``--grant http:...``):
    the body's text, whitespace folded, or ``HTTP <status>: <body>``."""
    r = http(url.strip().strip("'\""))
    body = " ".join(r["body"].split())[:max_chars]
    return body if r["status"] == 200 else f"HTTP {r['status']}: {body}"


def run_tool(tools: dict, name: str, arg: str, max_chars: int = 400) -> str:
    """``tools[name](arg)`` as one line of at most ``max_chars``; a tool's error (bad
    arithmetic, a refused or failed system call) becomes ``error: Type: message``, so
    the model reads it as the tool's result and the program goes on."""
    try:
        result = tools[name](arg)
    except (SyntaxError, ValueError, ArithmeticError, SyscallError) as e:
        result = f"error: {type(e).__name__}: {e}"
    return " ".join(result.split())[:max_chars]


class Writer:
    """One KV file, and the tokens not yet fed to it (`pending`).  `fed` counts
    the tokens this writer fed to the model (each once: nothing is recomputed);
    `generated` the tokens the model decoded for it (free text and choices)."""

    def __init__(self, f: KVFile, tok, text: str = ""):
        self.f, self.tok, self.eos = f, tok, set(tok.eos_ids)
        self.pending, self.fed, self.generated = tok.encode(text) if text else [], 0, 0

    def _pred(self, **kw) -> int:
        t = pred(self.f, self.pending, output="argmax", **kw)
        self.fed, self.pending = self.fed + len(self.pending), []
        return t

    def write(self, text: str) -> None:
        """Append forced text (an observation, a line opening); fed with the next step."""
        self.pending = self.pending + self.tok.encode(text)

    def flush(self) -> None:
        """Feed what is pending (the file then holds all the text written so far)."""
        if self.pending:
            self._pred()

    def until(self, stop: str, limit: int, close: str = "") -> str:
        """Greedy text up to the first character of ``stop`` (or EOS or ``limit``
        tokens); the file gets that text + ``close``, whatever the model wrote after."""
        ids: list[int] = []
        while len(ids) < limit:
            t = self._pred()
            self.generated += 1
            if t in self.eos:
                break
            ids.append(t)
            self.pending = [t]                               # generated, not yet in the KV
            text = self.tok.decode(ids)
            cut = min((text.index(c) for c in stop if c in text), default=-1)
            if cut >= 0:
                head = self.tok.decode(ids[:-1])             # already in the KV
                kept = text[:cut] + close
                self.pending = self.tok.encode(kept[len(head):]) if kept.startswith(head) else [t]
                return text[:cut]
        self.write(close)
        return self.tok.decode(ids)

    def choose(self, options: Sequence[str]) -> str:
        """The model picks one of ``options``, constrained token by token with a mask where
        the options still alive differ; a token they all share next is written without a
        forward pass (it is fed with the next step)."""
        if not options:
            raise ValueError("choose needs at least one option")
        seqs = [self.tok.encode(o) for o in options]
        if len(options) == 1:
            self.pending = self.pending + seqs[0]
            return options[0]
        done: list[int] = []
        while True:
            live = [s for s in seqs if s[:len(done)] == done]
            allowed = sorted({s[len(done)] for s in live})
            if len(allowed) == 1:                            # forced: nothing for the model to decide
                done.append(allowed[0])
                self.pending = self.pending + allowed
            else:
                done.append(self._pred(mask=allowed))
                self.generated += 1
                self.pending = [done[-1]]
            if done in seqs:
                return options[seqs.index(done)]
