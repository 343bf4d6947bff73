"""KVFS on the embedded SmolLM2: prefix reuse (time to first token), tier swap-in cost and
fork sharing.

    python perf/bench_kvfs.py [--rounds 5] [--prefix 1500] [--chunk 512] [--swap-dir DIR]
                              [--fork-tokens 2000] [--forks 64]

Measures, in interleaved rounds (A B C D E A B C D E ...) so machine noise hits every
contender alike, and reports medians:
  * time to first token (TTFT) of a prompt = a --prefix-token document + a ~20-token
    question, two ways:
      (a) reuse:     the document is an open KV file; fork it, pred only the question
      (b) recompute: pred all prefix + question tokens on a fresh KV file (one call)
    TTFT is wall time from the start of the call(s) to the argmax of the first
    next-token logits; the ratio (b) / (a) has a target of >= 10x.
  * swap cost per page of that document's KV pages (``engine.kv.page_bytes`` each):
    swap-out (device -> tier) and swap-in (tier -> device) through ``fs.pager``, for
      - the host tier (host_pages >= the file's pages, no swap file)
      - the disk tier (host_pages=0, a swap file in --swap-dir), reading back through
        the OS page cache (the pages were just written), and cold: after fsync and
        posix_fadvise(DONTNEED) drop the swap file from the page cache
    reported as median microseconds per page and MB/s (10^6 bytes) of swap-in.
A reuse result is checked against the logits before any swapping (max |diff| printed).
  * fork sharing, in device pages (asserted): a --fork-tokens file (a multiple of the page
    size) forked --forks times, then one token appended to each fork; again with the file
    truncated by 10 tokens (its last page partial, shared until each fork copies it).
    tests/e2e/model/test_kvfs_smollm2.py checks the same accounting, and the logits, on a smaller file.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from symphony.engine.config import EngineConfig                       # noqa: E402
from symphony.engine.engine import Engine                             # noqa: E402
from symphony.kvfs import KVFS, KVFSConfig, KVPred, Principal  # noqa: E402
from symphony.engine.loader import load_model                         # noqa: E402

ME = Principal("bench", 1)
QUESTION = "\n\nQuestion: Which robot counted the most stars before sunrise, and where did it walk?"
COLORS = ("red", "green", "blue", "amber", "violet", "silver", "golden")
PLACES = ("harbour", "library", "market", "observatory", "garden")


def document(tok, n):
    """``n`` tokens of deterministic plain English."""
    paras, i = [], 0
    while True:
        for _ in range(100):
            paras.append(f"Note {i}: the {COLORS[i % 7]} robot number {i * 37 % 101} walked to the "
                         f"{PLACES[i % 5]} and counted {i * i % 97} stars before sunrise.")
            i += 1
        ids = tok.encode(" ".join(paras))
        if len(ids) >= n:
            return ids[:n]


def build_file(fs, ids, chunk, path=None):
    h = fs.create(ME, path)
    for i in range(0, len(ids), chunk):
        fs.pred(ME, h, ids[i:i + chunk])
    return h


def ttft_reuse(fs, doc_h, question):
    t0 = time.perf_counter()
    c = fs.fork(ME, doc_h)
    logits = fs.pred(ME, c, question)
    int(logits.argmax())
    dt = time.perf_counter() - t0
    fs.close(ME, c)
    return dt, logits


def ttft_recompute(fs, prompt):
    t0 = time.perf_counter()
    h = fs.create(ME)
    logits = fs.pred(ME, h, prompt)
    int(logits.argmax())
    dt = time.perf_counter() - t0
    fs.close(ME, h)
    return dt, logits


def swap_cycle(fs, h, cold=False):
    """Swap the file's pages out and back in; returns (out_s, in_s, pages)."""
    blocks = list(fs.handles[h].inode.blocks)
    assert all(b.device >= 0 for b in blocks)
    t0 = time.perf_counter()
    fs.pager.swap_out(blocks)
    t_out = time.perf_counter() - t0
    if cold:
        fd = fs.pager._fd
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    fs.pager.swap_in(blocks)
    t_in = time.perf_counter() - t0
    return t_out, t_in, len(blocks)


def fork_sharing(weights, tok, n_tokens, n_forks, chunk, S=16):
    """[(file tokens, file pages, device pages added by the forks, and by one token appended
    to each fork)] for the whole file, then the file truncated by 10 tokens."""
    assert n_tokens % S == 0, "the first file ends on a page boundary"
    eng = Engine(weights, tok, EngineConfig(page_size=S, num_pages=n_tokens // S + n_forks + 16))
    fs = KVFS(eng, KVFSConfig(host_pages=0), restore=False)
    used = lambda: eng.kv.allocator.num_used          # noqa: E731
    start = used()
    h = build_file(fs, document(tok, n_tokens), chunk)
    rows = []
    for n in (n_tokens, n_tokens - 10):
        fs.truncate(ME, h, n)
        file_pages = -(-n // S)
        assert used() - start == file_pages
        forks = [fs.fork(ME, h) for _ in range(n_forks)]
        after_fork = used() - start - file_pages
        fs.pred_batch([KVPred(ME, f, [100 + i]) for i, f in enumerate(forks)])
        after_append = used() - start - file_pages
        for f in forks:
            fs.close(ME, f)
        rows.append((n, file_pages, after_fork, after_append))
        assert after_fork == 0 and after_append == n_forks, rows[-1]     # no page; one page per fork
    fs.close(ME, h)
    fs.close_all()
    assert used() == start
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=1500, help="document tokens already in a KV file")
    ap.add_argument("--chunk", type=int, default=512, help="pred chunk size when building the file")
    ap.add_argument("--swap-dir", default=None, help="directory of the disk tier's swap file "
                    "(default: a fresh temporary directory)")
    ap.add_argument("--fork-tokens", type=int, default=2000, help="tokens of the forked file (a multiple of 16)")
    ap.add_argument("--forks", type=int, default=64, help="forks of that file")
    args = ap.parse_args()
    threads = torch.get_num_threads()
    print(f"# SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32), CPU, {threads} threads, "
          f"torch {torch.__version__}", flush=True)
    weights, tok = load_model(None, progress=False)
    doc, question = document(tok, args.prefix), tok.encode(QUESTION)
    prompt = doc + question
    S = 16
    n_pages = -(-len(doc) // S)
    # two copies of the document (host and disk KVFS) + a recompute + a fork, with room to spare
    eng = Engine(weights, tok, EngineConfig(page_size=S, num_pages=2 * n_pages + -(-len(prompt) // S) + 16))
    page_bytes = eng.kv.page_bytes
    swap_dir = args.swap_dir or tempfile.mkdtemp(prefix="bench-kvfs-")
    print(f"# prompt {len(doc)} document + {len(question)} question tokens; document file "
          f"{n_pages} pages of {S} tokens, {page_bytes} bytes each; swap dir {swap_dir}; "
          f"{args.rounds} interleaved rounds", flush=True)

    fs_host = KVFS(eng, KVFSConfig(host_pages=n_pages), restore=False)
    fs_disk = KVFS(eng, KVFSConfig(host_pages=0, swap_dir=swap_dir), restore=False)
    doc_h = build_file(fs_host, doc, args.chunk, "/tmp/doc.kv")
    doc_d = build_file(fs_disk, doc, args.chunk, "/tmp/doc.kv")
    _, first = ttft_reuse(fs_host, doc_h, question)                  # warm-up, and the reference logits
    _, full = ttft_recompute(fs_host, prompt)
    swap_cycle(fs_host, doc_h)
    swap_cycle(fs_disk, doc_d)
    print(f"# reuse vs recompute logits: max |diff| {float((first - full).abs().max()):.2e}", flush=True)

    res = {k: [] for k in ("reuse", "recompute", "host_out", "host_in", "disk_out", "disk_in",
                           "cold_out", "cold_in")}
    for r in range(args.rounds):
        res["reuse"].append(ttft_reuse(fs_host, doc_h, question)[0])
        res["recompute"].append(ttft_recompute(fs_host, prompt)[0])
        for name, fs, h, cold in (("host", fs_host, doc_h, False), ("disk", fs_disk, doc_d, False),
                                  ("cold", fs_disk, doc_d, True)):
            t_out, t_in, n = swap_cycle(fs, h, cold)
            res[f"{name}_out"].append(t_out / n)
            res[f"{name}_in"].append(t_in / n)
        print(f"  round {r + 1}/{args.rounds}: TTFT reuse {res['reuse'][-1] * 1e3:.1f} ms, recompute "
              f"{res['recompute'][-1] * 1e3:.1f} ms; swap-in us/page host {res['host_in'][-1] * 1e6:.0f}, "
              f"disk {res['disk_in'][-1] * 1e6:.0f}, cold {res['cold_in'][-1] * 1e6:.0f}", flush=True)
    # the reused prefix survived every swap round trip unchanged
    _, after = ttft_reuse(fs_host, doc_h, question)
    _, after_d = ttft_reuse(fs_disk, doc_d, question)
    drift = max(float((after - first).abs().max()), float((after_d - first).abs().max()))
    med = {k: statistics.median(v) for k, v in res.items()}

    print(f"\n| time to first token ({len(doc)} + {len(question)} tokens) | median ms | tokens computed |")
    print("|---|---|---|")
    print(f"| (a) fork the open {len(doc)}-token KV file, pred the question | {med['reuse'] * 1e3:.1f} | "
          f"{len(question)} |")
    print(f"| (b) recompute: pred all {len(prompt)} tokens on a fresh file | {med['recompute'] * 1e3:.1f} | "
          f"{len(prompt)} |")
    mb = lambda s: page_bytes / s / 1e6
    print(f"\n| tier ({page_bytes / 2**10:.0f} KiB pages) | swap-out us/page | swap-in us/page | "
          f"swap-in MB/s |")
    print("|---|---|---|---|")
    for name, label in (("host", "host memory"), ("disk", "disk swap file, page cache warm"),
                        ("cold", "disk swap file, cold (fsync + fadvise DONTNEED)")):
        print(f"| {label} | {med[name + '_out'] * 1e6:.0f} | {med[name + '_in'] * 1e6:.0f} | "
              f"{mb(med[name + '_in']):.0f} |")
    print(f"\nrecompute / reuse TTFT:       {med['recompute'] / med['reuse']:.1f}x (target >= 10)")
    print(f"swap-in of the whole {n_pages}-page document: host {med['host_in'] * n_pages * 1e3:.1f} ms, "
          f"disk {med['disk_in'] * n_pages * 1e3:.1f} ms, cold disk {med['cold_in'] * n_pages * 1e3:.1f} ms "
          f"(recompute: {med['recompute'] * 1e3:.0f} ms)")
    print(f"reused-prefix logits after {args.rounds + 1} swap round trips: max |diff| {drift:.2e}")
    for fs, h in ((fs_host, doc_h), (fs_disk, doc_d)):
        fs.close(ME, h)
        fs.remove(ME, "/tmp/doc.kv")
        fs.close_all()
    if args.swap_dir is None:
        os.rmdir(swap_dir)                   # the swap file itself was anonymous (unlinked)
    for n, pages, forked, appended in fork_sharing(weights, tok, args.fork_tokens, args.forks, args.chunk):
        print(f"fork sharing: a {n}-token file ({pages} pages) forked {args.forks} times: +{forked} device "
              f"pages; one token appended to each fork: +{appended} (vs {args.forks * pages} for "
              f"{args.forks} copies)")


if __name__ == "__main__":
    main()
