"""The value types of symphony-kernel's flags (argparse ``type=`` functions): each returns
the value or raises ``argparse.ArgumentTypeError`` saying what it expected."""
from __future__ import annotations

import argparse


def nonneg_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return n


def positive_int(text: str) -> int:
    n = nonneg_int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return n


def pages_or_percent(text: str):
    """'N' pages (an int) or 'N%' of the pool (a float in (0, 1])."""
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            pct = -1.0
        if not 0 < pct <= 100:
            raise argparse.ArgumentTypeError(f"expected a percentage in (0, 100], got {text!r}")
        return pct / 100
    return nonneg_int(text)


def host_pages(text: str):
    return "auto" if text == "auto" else nonneg_int(text)


def umask(text: str) -> int:
    try:
        m = int(text, 8)
    except ValueError:
        m = -1
    if not 0 <= m <= 0o777:
        raise argparse.ArgumentTypeError(f"expected an octal umask 000..777, got {text!r}")
    return m
