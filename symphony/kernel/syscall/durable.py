"""The slow KVFS system calls as jobs of the slow lane (slowlane.py): durable
syncs and directory listings, a bounded slice at a time.

    sync_job(fs, writer, inode)   the file's blocks held (`store.sync_snapshot`),
                                  copied out SYNC_SLICE_PAGES pages a slice,
                                  written and fsynced by the writer thread, then
                                  installed as the durable copy; returns {}
    list_job(fs, who, path)       the directory's entries, LIST_SLICE a slice

Each checks what it is asked at its first slice (an error then is the call's
answer), and sees the file or directory as it was then: a sync writes the
file's content at the call (later writes copy its shared pages first); a
listing skips entries removed meanwhile.
"""
from __future__ import annotations

import itertools
from typing import Generator

from symphony.kvfs.fs import list_entry
from symphony.kvfs.store import install, release_snapshot, sync_snapshot, write_file

from symphony.kernel.syscall.slowlane import WAIT, Writer

SYNC_SLICE_PAGES = 8        # pages copied out per slice (a SmolLM2 page: 720 KiB)
LIST_SLICE = 256            # entries made per slice

_tags = itertools.count(1)


def sync_job(fs, writer: Writer, inode) -> Generator:
    """Make ``inode`` (a named file, checked by the caller) durable."""
    while not writer.claim():                      # at most `places` files' copies at once
        yield WAIT
    try:
        snap = sync_snapshot(fs, inode)
        pages = []
        try:
            for i in range(0, len(snap.blocks), SYNC_SLICE_PAGES):
                pages += [fs.pager.read(b) for b in snap.blocks[i:i + SYNC_SLICE_PAGES]]
                yield
        finally:
            release_snapshot(fs, snap)
        box: dict = {}
        tag, where = next(_tags), fs.config.durable_dir
        writer.submit(lambda: write_file(where, snap, pages, tag), lambda r, e: box.update(r=r, e=e))
        while not box:
            yield WAIT
    finally:
        writer.release()
    if box["e"] is not None:
        raise box["e"]
    install(fs, inode, snap, *box["r"])
    return {}


def list_job(fs, who, path: str) -> Generator:
    """The entries of directory ``path`` as ``who`` may list them."""
    node = fs.listable(who, path)
    names = node.sorted_names()
    yield
    out = []
    for i in range(0, len(names), LIST_SLICE):
        for name in names[i:i + LIST_SLICE]:
            child = node.children.get(name)
            if child is not None:
                out.append(list_entry(name, child))
        yield
    return out
