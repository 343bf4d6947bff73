"""perf/bench_decode.py's table of the default's choice: default / fastest is taken per round
(the two timed side by side in that round), then the median and the spread, not as a ratio of
two medians from different rounds (on a VM whose speed drifts between rounds those put the
same kernel at 0.87 of itself)."""
from __future__ import annotations

import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "perf"))

import bench_decode  # noqa: E402


def test_default_over_fastest_is_paired_by_round(capsys):
    # the default and path 9 drift together round by round: paired, the default is 1.00 of it
    res = {1: {"default": [100.0, 150.0, 120.0], 9: [100.0, 150.0, 120.0], 12: [99.0, 98.0, 97.0]},
           8: {"default": [300.0, 200.0, 330.0], 2: [310.0, 320.0, 300.0], 9: [250.0, 260.0, 255.0]}}
    bench_decode.print_paths(res, (576, 576))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "rows" not in line}
    assert rows["1"][1] == "120.0 (9)" and rows["1"][2] == "1.00 (1.00..1.00)"
    assert rows["8"][1] == "310.0 (2)" and rows["8"][2] == "0.97 (0.62..1.10)"
