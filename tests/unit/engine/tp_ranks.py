"""Two real gloo ranks for test_tp_group.py: ``python tp_ranks.py SCENARIO RANK INIT``.

Each builds a `TPGroup` of two ranks (no model) and plays its part; rank 0 prints one JSON
line with what it saw.  Scenarios:

    mismatch   rank 1 was started with another --kv-memory-mb: both refuse, naming it
    idle_kill  the group starts, then rank 1 is killed by the test while idle: rank 0's
               heartbeat finds it (no command is ever sent)
    hang       rank 0 starts an all-reduce that rank 1 never joins: the watch finds it
               before gloo's own timeout (timeout + BACKEND_MARGIN_S)
    close      rank 1 leaves the group at once and stays alive 4 s; rank 0 leaves 2.5 s
               later (a worker told to stop before the kernel closes its own side): both
               exit 0, rank 0's heartbeat never left blocked in a round rank 1 skipped
"""
import json
import sys
import time

import torch

from symphony.engine.tp.agree import TPMismatch, record
from symphony.engine.tp.group import TPGroup

TIMEOUT_S = 2.0


def main(scenario: str, rank: int, init: str) -> int:
    engine = {"dtype": "float32", "page_size": 16, "num_pages": 100, "kv_memory_bytes": 64 << 20}
    if scenario == "mismatch" and rank == 1:
        engine["kv_memory_bytes"] = 32 << 20
    rec = record(node=rank, rank=rank, model="ab" * 32, engine=engine, activations="auto", size=2,
                 timeout_s=TIMEOUT_S)
    broke = []
    try:
        g = TPGroup(rank, 2, init, "gloo", TIMEOUT_S, record=rec, on_broken=broke.append)
    except TPMismatch as e:
        print(json.dumps({"rank": rank, "mismatch": str(e)}), flush=True)
        return 2
    print(json.dumps({"rank": rank, "joined": True}), flush=True)
    t0 = time.monotonic()
    if scenario == "idle_kill":
        if rank == 1:
            time.sleep(60)                      # killed by the test
        while not broke and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        print(json.dumps({"rank": 0, "broken": g.broken, "after_s": time.monotonic() - t0}), flush=True)
        return 0
    if scenario == "hang":
        if rank == 1:
            time.sleep(60)                      # never joins the all-reduce; killed by the test
        err = None
        try:
            g.all_reduce(torch.ones(3))
        except Exception as e:                  # gloo's own timeout, after the watch
            err = f"{type(e).__name__}: {e}"
        print(json.dumps({"rank": 0, "broken": g.broken, "first": broke[0] if broke else None,
                          "raised": err, "after_s": time.monotonic() - t0}), flush=True)
        return 0
    if scenario == "close":
        if rank == 1:
            g.close()
            time.sleep(4)
            return 0
        time.sleep(2.5)
        g.close()
        print(json.dumps({"rank": 0, "broken": g.broken, "heart_alive": g._heart.is_alive(),
                          "after_s": time.monotonic() - t0}), flush=True)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
