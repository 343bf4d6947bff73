"""The kernel's heap policy (symphony/kernel/heap.py): collect, freeze, raise the young threshold."""
import subprocess
import sys

import pytest

from conftest import REPO


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_settle_freezes_what_lives_and_raises_the_young_threshold():
    out = _run("import gc, json\n"
               "from symphony.kernel import heap\n"
               "keep = [[i] for i in range(5000)]\n"
               "cycle = []; cycle.append(cycle); del cycle\n"       # garbage: collected, not frozen
               "r = heap.settle('test', 12345)\n"
               "print(r['frozen'], gc.get_freeze_count(), *gc.get_threshold(), gc.garbage == [])")
    frozen, count, young, _, _, clean = out
    assert int(frozen) == int(count) >= 5000
    assert int(young) == 12345
    assert clean == "True"


def test_settle_without_young_keeps_pythons_thresholds():
    out = _run("import gc\nfrom symphony.kernel import heap\nt = gc.get_threshold()\nheap.settle('test')\n"
               "print(gc.get_threshold() == t, gc.get_freeze_count() > 0)")
    assert out == ["True", "True"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "700"])
def test_settle_refuses_a_bad_threshold(bad):
    from symphony.kernel import heap
    with pytest.raises(ValueError, match="young must be an int"):
        heap.settle("test", bad)
