"""The syscall thread's host time per pred call, in process, without LIP processes.

    python perf/bench_host.py [--lips 64] [--steps 200] [--rounds 5] [--device sim:step_ms=0,...]
                              [--profile OUT.prof]

Builds the kernel's real syscall server (kernel/syscall/server.py: KVFS, the scheduler, the
rings, the step) on a simulated device whose forward pass takes no time (engine/sim.py), gives
it --lips LIPs whose rings this process writes directly (what a LIP's `pred(f, [t],
output="argmax")` writes: the body built by the LIP library's schema, the token), and times what
the syscall thread does per decode step of all of them (the fake LIPs' own writes and reads,
done on the same thread, are timed apart and left out):

    handle   poll every ring, read, decode and check each call, queue it   (server._poll/_handle)
    launch   residency and the scheduler pick the step, KVFS prepares it    (Stepper.launch,
             less the simulated pass itself)
    finish   KVFS commits, the replies are written                        (Stepper.finish)

with the step run inline (no device thread: every microsecond here is the syscall thread's).
Reported per pred call: the median over --rounds rounds of --steps steps, wall and CPU time of
this thread, and each part; the greedy tokens are checked against the simulated device's.
This is the figure the kernel's `host_us_per_pred` (perf/bench_kernel.py --device sim) measures
with real LIPs; here no other process competes for the CPU, so it is steady on a busy machine.
"""
from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from symphony.engine.config import EngineConfig               # noqa: E402
from symphony.engine.sim import SimEngine, parse_profile      # noqa: E402
from symphony.ipc import abi, schema                           # noqa: E402
from symphony.ipc.kernel_side import KernelSide                # noqa: E402
from symphony.ipc.layout import REQ_BODY_OFF, REQ_HDR, REQUEST, RESP_HDR, RESPONSE, FREE, U32  # noqa: E402
from symphony.ipc.wait import WaitSet                          # noqa: E402
from symphony.kernel.syscall.proc import LipProc, ServedLips   # noqa: E402
try:
    from symphony.kernel import heap                           # noqa: E402
except ImportError:                                            # (an older tree: the heap as Python has it)
    heap = None
from symphony.kernel.syscall.server import SyscallServer       # noqa: E402
from symphony.kvfs import KVFS, KVFSConfig                     # noqa: E402

import orjson                                                  # noqa: E402


class FakeLip:
    """One LIP's side of a ring, written directly (one slot, one call at a time)."""

    def __init__(self, ring: KernelSide):
        self.ring, self.mm = ring, ring._mm
        self.off = ring._slots_off                 # slot 0
        self.state = ring._st_lo
        self.call_id = 0

    def call(self, op: int, body: bytes, tokens=()) -> None:
        self.call_id += 1
        mm, off = self.mm, self.off
        mm[off + REQ_BODY_OFF:off + REQ_BODY_OFF + len(body)] = body
        t0 = off + REQ_BODY_OFF + ((len(body) + 7) & ~7)
        toks = np.asarray(tokens, dtype="<i4").tobytes()
        mm[t0:t0 + len(toks)] = toks
        REQ_HDR.pack_into(mm, off, self.call_id, op, len(body), len(tokens), 0)
        U32.pack_into(mm, self.state, REQUEST)
        os.eventfd_write(self.ring.bell_fd, 1)      # the doorbell, as a LIP rings it

    def reply(self) -> dict:
        mm, off = self.mm, self.off
        assert U32.unpack_from(mm, self.state)[0] == RESPONSE, "no reply"
        cid, status, jl, *_ = RESP_HDR.unpack_from(mm, off)
        body = orjson.loads(mm[off + 32:off + 32 + jl])
        U32.pack_into(mm, self.state, FREE)
        assert cid == self.call_id and status == abi.OK, body
        return body


def build(n: int, device: str, tokens: int):
    """The server and ``n`` LIPs, each with room for ``tokens`` tokens of KV."""
    pages = n * (tokens // 16 + 2) + 16
    eng = SimEngine.load(config=EngineConfig(page_size=16, num_pages=pages, dtype=torch.bfloat16),
                         profile=parse_profile(device))
    served = ServedLips()
    fs = KVFS(eng, KVFSConfig(host_pages=64), evict_first=served.swap_out_first, pinned=served.running_ids)
    door = WaitSet()
    srv = SyscallServer(eng, fs, door, lambda *a: None, lambda *a: None, lips=served, overlap=False)
    srv.device.start()
    srv.host.clock = time.thread_time          # the parts in CPU time: steady on a busy machine
    if heap is not None:                       # the heap as the kernel has it when it serves
        heap.settle("bench_host", heap.KERNEL_YOUNG)
    lips = []
    for i in range(n):
        ring = KernelSide.create(f"symhost{secrets.token_hex(3)}", n_slots=1, slot_bytes=65536,
                                 arena_bytes=1 << 16, waitset=door)
        lip = LipProc(id=i + 1, user=f"u{i % 4}", filename="bench.py", args=[], ring=ring, grants={}, limits={})
        srv.add(lip)
        lips.append((lip, FakeLip(ring)))
    return eng, srv, lips, door


def serve_until_answered(srv, fakes) -> None:
    """The syscall thread's loop, inline, until every fake LIP's call is answered."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        idle = srv._serve_once()
        if idle is not None:
            srv.door.wait(*idle)
        if all(U32.unpack_from(f.mm, f.state)[0] == RESPONSE for f in fakes):
            return
    raise RuntimeError("calls were not answered in 10 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lips", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200, help="decode steps a round (default 200)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="sim:step_ms=0,call_us=0,token_us=0,kv_ns=0",
                    help="the simulated device (default: a pass that takes no time)")
    ap.add_argument("--profile", default=None, metavar="OUT", help="cProfile one round into OUT")
    args = ap.parse_args()
    eng, srv, lips, door = build(args.lips, args.device, 64 + args.steps * args.rounds)
    fakes = [f for _, f in lips]
    try:
        handles = []
        for f in fakes:                                     # a KV file and a prompt each
            f.call(abi.KV_CREATE, schema.encode(schema.build(abi.KV_CREATE)))
        serve_until_answered(srv, fakes)
        handles = [f.reply()["handle"] for f in fakes]
        prompt = eng.tokenizer.encode("The quick brown fox jumps over the lazy dog.")

        def pred_body(h, n):
            return schema.encode(schema.build(abi.PRED, kv=h, n_tokens=n, output="argmax", k=20, temperature=1.0,
                                              top_p=1.0, top_k=0))
        for f, h in zip(fakes, handles):
            f.call(abi.PRED, pred_body(h, len(prompt)), prompt[:-1] + [100 + h])
        serve_until_answered(srv, fakes)
        toks = [f.reply()["token"] for f in fakes]
        bodies = [pred_body(h, 1) for h in handles]
        walls, cpus, parts = [], [], []
        for r in range(args.rounds):
            prof = None
            if args.profile and r == args.rounds - 1:
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            h0 = dict(srv.host.seconds)
            dev0 = srv.device.cpu_s
            t0, c0 = time.perf_counter(), time.thread_time()
            lips_cpu = 0.0                          # the fake LIPs' own work (this thread's too): left out
            for _ in range(args.steps):
                l0 = time.thread_time()
                for f, b, t in zip(fakes, bodies, toks):
                    f.call(abi.PRED, b, (t,))
                lips_cpu += time.thread_time() - l0
                serve_until_answered(srv, fakes)
                l0 = time.thread_time()
                toks = [f.reply()["token"] for f in fakes]
                lips_cpu += time.thread_time() - l0
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0 - lips_cpu
            if prof is not None:
                prof.disable()
                prof.dump_stats(args.profile)
            n = args.steps * args.lips
            dev = srv.device.cpu_s - dev0
            walls.append(wall / n * 1e6)
            cpus.append((cpu - dev) / n * 1e6)
            parts.append({p: (srv.host.seconds[p] - h0[p]) / n * 1e6 for p in h0})
            parts[-1]["launch"] -= dev / n * 1e6
            print(f"round {r + 1}: {cpus[-1]:.2f} us of CPU a pred call on the syscall thread (wall {walls[-1]:.2f} "
                  f"us with the simulated pass); "
                  + ", ".join(f"{p} {v:.2f}" for p, v in parts[-1].items())
                  + f"; the simulated pass {dev / args.steps * 1e6:.0f} us a step", flush=True)
        med = statistics.median
        print(f"\n{args.lips} LIPs, {args.steps} steps x {args.rounds} rounds on {os.cpu_count()} cores "
              f"({torch.__version__}): the syscall thread's CPU time a pred call, median {med(cpus):.2f} us "
              f"(rounds {', '.join(f'{w:.2f}' for w in cpus)}); "
              + ", ".join(f"{p} {med(x[p] for x in parts):.2f}" for p in parts[0]))
    finally:
        for lip, _ in lips:
            lip.ring.unlink()
            lip.ring.close()
        door.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
