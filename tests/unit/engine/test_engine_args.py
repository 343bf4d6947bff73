"""The engine's flags (symphony/engine/args.py): one set for ``symphony-kernel`` and
``symphony chat|generate``, turned into a checked `EngineConfig`.  No model is loaded."""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from symphony.engine.args import DTYPE_NAMES, EngineArgs
from symphony.engine.config import DTYPES, ConfigError

REPO = Path(__file__).resolve().parents[3]


def _parse(*argv) -> EngineArgs:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    return EngineArgs.from_cli_args(p.parse_args(list(argv)))


def test_the_flags_default_to_the_dataclass_defaults():
    assert _parse() == EngineArgs()
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert vars(p.parse_args([])).keys() == {f.name for f in dataclasses.fields(EngineArgs)}   # one flag a field


def test_flags_become_a_checked_config():
    cfg = _parse("--page-size", "8", "--kv-memory-mb", "3", "--dtype", "bfloat16", "--no-cuda-graphs",
                 "--quantize", "int4").to_config()
    assert (cfg.device, cfg.page_size, cfg.kv_memory_bytes, cfg.dtype, cfg.cuda_graphs, cfg.quantize) == \
        ("cpu", 8, 3 << 20, torch.bfloat16, False, "int4")
    assert _parse().to_config().cuda_graphs is None                        # graphs: the device decides
    with pytest.raises(ConfigError, match="page_size must be in 1..1024, got 0"):
        _parse("--page-size", "0").to_config()
    with pytest.raises(ConfigError, match="quantize=... needs weights"):
        _parse("--quantize", "int8", "--weights", "float").to_config()


def test_the_kv_pool_is_committed_in_the_background_unless_asked_lazy():
    assert _parse().to_config().kv_commit == "background"
    assert _parse("--kv-commit", "lazy").to_config().kv_commit == "lazy"
    with pytest.raises(SystemExit):
        _parse("--kv-commit", "eager")


def test_gpus_name_a_device_or_one_tensor_parallel_rank_each():
    assert _parse().device() == "cpu" and _parse("--gpus", " 1 ").device() == "cuda:1"
    two = _parse("--gpus", "0,1")
    assert two.devices() == ["cuda:0", "cuda:1"] and two.device() == "cuda:0" and two.tp_size() == 2
    assert _parse().tp_size() == 1 and _parse("--tp", "3").tp_size() == 3
    for bad in ("x", ",", "0,0", "1,"):
        with pytest.raises(ConfigError, match="--gpus: a GPU index or distinct indexes"):
            _parse("--gpus", bad).device()
    for flags, msg in ((("--gpus", "0,1", "--tp", "3"), "so --tp must be 2"), (("--tp", "0"), "1..64"),
                       (("--nnodes", "2"), "--master-addr"), (("--tp", "2", "--tp-timeout", "0"), "--tp-timeout")):
        with pytest.raises(ConfigError, match=msg):
            _parse(*flags).tp_size()


def test_dtype_choices_are_the_configs_dtypes():
    assert tuple(DTYPES) == DTYPE_NAMES
    with pytest.raises(SystemExit):
        _parse("--dtype", "float64")


def test_adding_the_flags_imports_no_torch():
    """`symphony ps` builds the parser with the engine's flags: it must not pay for torch."""
    code = ("import argparse, sys; from symphony.engine.args import EngineArgs; "
            "EngineArgs.add_cli_args(argparse.ArgumentParser()); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
