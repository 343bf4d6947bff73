"""The engine's command-line flags, in one place for every command that builds an engine.

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)                       # --model, --gpus, --dtype, ...
    args = EngineArgs.from_cli_args(p.parse_args())
    engine = args.load()                             # ConfigError, ModelLoadError

``symphony-kernel`` (symphony/kernel_cli.py) and ``symphony chat|generate`` (symphony/cli.py)
take the same flags with the same meaning.  `to_config` turns them into a validated
`EngineConfig`; `load` also sets the process-wide choice of CPU kernels (``--activations``)
and loads the model.  Adding the flags imports no torch: ``symphony ps`` builds the same parser.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .config import EngineConfig

__all__ = ["EngineArgs"]

DTYPE_NAMES = ("float32", "bfloat16", "float16")   # engine.config.DTYPES' keys (no torch import here)


@dataclass(frozen=True)
class EngineArgs:
    """The engine's flags, as parsed (defaults: what the flags default to)."""

    model: Optional[str] = None          # GGUF file or safetensors directory; None: the embedded SmolLM2
    gpus: Optional[str] = None           # "0": that GPU; None: the CPU
    kv_memory_mb: int = 256
    page_size: int = 16
    dtype: Optional[str] = None          # a key of DTYPES; None: the device's default
    weights: str = "auto"
    quantize: Optional[str] = None
    activations: str = "auto"            # "int8": the int8-activation CPU kernels
    no_cuda_graphs: bool = False

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        """Add the engine's flags to ``p`` (their dests are this class's fields)."""
        p.add_argument("--model", default=None,
                       help="GGUF file or Hugging Face safetensors directory (default: embedded "
                            "SmolLM2-135M-Instruct)")
        p.add_argument("--gpus", default=None, help="GPU index to run on, e.g. 0 (default: CPU)")
        p.add_argument("--kv-memory-mb", type=int, default=256, help="KV page pool size in MiB (default 256)")
        p.add_argument("--page-size", type=int, default=16, help="positions per KV page (default 16)")
        p.add_argument("--dtype", default=None, choices=list(DTYPE_NAMES),
                       help="weights, activations and KV pool (default float32 on a CPU, bfloat16 on a GPU)")
        p.add_argument("--weights", default="auto", choices=["auto", "quantized", "float"],
                       help="quantized GGUF tensors: keep them quantized in memory and compute on their "
                            "bits, or dequantize them to --dtype at load (default auto: quantized on a CPU, "
                            "float on a GPU)")
        p.add_argument("--quantize", default=None, choices=["int8", "int4"],
                       help="quantize float weights (safetensors, F16/F32 GGUF) at load, groups of 32")
        p.add_argument("--activations", default="auto", choices=["auto", "int8"],
                       help="what quantized weights multiply on a CPU: auto (x rounded to 15 bits per block "
                            "of 16 on CPUs with AVX-512 VNNI or AVX2 without AVX-512, float32 otherwise: "
                            "logits within ~1/2000 of their scale) or int8 (faster for batches, but logits "
                            "move by ~4%% of their scale, as llama.cpp's do)")
        p.add_argument("--no-cuda-graphs", action="store_true",
                       help="run decode steps eagerly instead of replaying captured CUDA graphs (GPU only)")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        """The engine's flags out of a namespace parsed with `add_cli_args`'s flags (others ignored)."""
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})

    def device(self) -> str:
        """The torch device ``--gpus`` names ("cpu" without it); ConfigError if it names several or none."""
        from .config import ConfigError
        if not self.gpus:
            return "cpu"
        ids = [g.strip() for g in self.gpus.split(",") if g.strip()]
        if len(ids) != 1 or not ids[0].isdigit():
            raise ConfigError(f"--gpus: one GPU index is supported for now, got {self.gpus!r}")
        return f"cuda:{ids[0]}"

    def to_config(self) -> "EngineConfig":
        """The validated `EngineConfig` the flags describe (ConfigError names what is wrong)."""
        from .config import DTYPES, EngineConfig
        return EngineConfig(device=self.device(), dtype=DTYPES[self.dtype] if self.dtype else None,
                            page_size=self.page_size, kv_memory_bytes=self.kv_memory_mb * 2**20,
                            cuda_graphs=False if self.no_cuda_graphs else None,
                            weights=self.weights, quantize=self.quantize)

    def load(self, cfg: "Optional[EngineConfig]" = None):
        """Select the CPU kernels ``--activations`` asks for and load the model into an `Engine`
        run as ``cfg`` (default: `to_config`).  ConfigError, or ModelLoadError (engine/loader.py)."""
        from .engine import Engine
        from .quant import set_int8_activations
        cfg = self.to_config() if cfg is None else cfg
        set_int8_activations(self.activations == "int8")
        return Engine.load(self.model, cfg)
