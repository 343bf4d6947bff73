"""The stock programs (the LIPs in userland/), found by name for ``symphony run NAME``.

They live at the top of a checkout (``userland/``); an installed wheel ships them inside the
package as ``symphony/_userland``. A LIP argument with a ``/`` or ending in ``.py`` is always a
path; anything else is a stock program's name (``chat``, ``rag``, ...), so a file ``chat`` in
the current directory is run as ``./chat``.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

_PACKAGED = Path(__file__).resolve().parent / "_userland"        # site-packages/symphony/_userland
_CHECKOUT = Path(__file__).resolve().parents[1] / "userland"     # <repo>/userland
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ProgramError(ValueError):
    """A LIP argument names no stock program (the message lists the ones there are)."""


def programs_dir() -> Path:
    """The folder of the stock programs: the installed package's copy, else the checkout's."""
    for d in (_PACKAGED, _CHECKOUT):
        if d.is_dir() and any(d.glob("*.py")):
            return d
    raise ProgramError(f"the stock programs were not found: neither {_PACKAGED} (an installed wheel's "
                       f"copy) nor {_CHECKOUT} (a source checkout) holds any")


def is_path(spec: str) -> bool:
    """Whether a LIP argument is a file path (has a path separator or ends in .py) rather than a name."""
    return "/" in spec or spec.endswith(".py")


def available() -> dict[str, str]:
    """Every stock program's name -> the first paragraph of its module docstring (one line),
    sorted by name.

    The docstring is read with ``ast`` (nothing is imported or run)."""
    out = {}
    for f in sorted(programs_dir().glob("*.py")):
        if not _NAME.fullmatch(f.stem) or f.stem.startswith("_"):
            continue
        try:
            doc = ast.get_docstring(ast.parse(f.read_text(encoding="utf-8"), str(f))) or ""
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            doc = ""
        out[f.stem] = " ".join(doc.strip().split("\n\n")[0].split())     # the first paragraph
    return out


def resolve(spec: str) -> Path:
    """The file a ``symphony run`` LIP argument names: ``spec`` itself if it is a path
    (see :func:`is_path`), else the stock program of that name; ProgramError for an unknown
    name or an empty argument."""
    if not isinstance(spec, str) or not spec:
        raise ProgramError("no program given: a stock program's name (symphony run --list) or a path")
    if is_path(spec):
        return Path(spec)
    names = available()
    if spec not in names:
        raise ProgramError(f"no stock program named {spec!r}; the stock programs are: {', '.join(names)} "
                           "(a file in the current directory: ./NAME)")
    return programs_dir() / f"{spec}.py"


def listing() -> str:
    """The text of ``symphony run --list``: one line per program, its name and what it does."""
    names = available()
    width = max((len(n) for n in names), default=0)
    return "\n".join(f"{n:<{width}}  {doc}".rstrip() for n, doc in names.items())
