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
    device_spec: str = "cpu"             # --device: "cpu", or "sim[:PROFILE]": a simulated device (engine/sim.py)
    kv_memory_mb: int = 256
    page_size: int = 16
    dtype: Optional[str] = None          # a key of DTYPES; None: the device's default
    kv_dtype: str = "auto"               # a key of DTYPES, or "auto" (`kv_dtype_name`)
    weights: str = "auto"
    quantize: Optional[str] = None
    activations: str = "auto"            # "int8": the int8-activation CPU kernels
    kv_commit: str = "background"        # the host KV pool's memory: "background" or "lazy"
    no_cuda_graphs: bool = False
    tp: Optional[int] = None             # tensor-parallel ranks on the CPU (gloo); --gpus 0,1: one per GPU
    tp_timeout: float = 60.0             # seconds a collective may wait for a rank
    nnodes: int = 1                      # machines the ranks span (torchrun's names)
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None    # None: 29500
    rendezvous: str = "auto"             # "env": a launcher's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK
    worker: bool = False                 # symphony-kernel --worker: another machine's ranks

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        """Add the engine's flags to ``p`` (their dests are this class's fields)."""
        p.add_argument("--model", default=None,
                       help="GGUF file or Hugging Face safetensors directory (default: embedded "
                            "SmolLM2-135M-Instruct)")
        p.add_argument("--gpus", default=None,
                       help="GPU index to run on, e.g. 0, or several, e.g. 0,1: one tensor-parallel rank "
                            "per GPU of one kernel (default: CPU); for several replicas run one kernel each "
                            "behind symphony-gateway")
        p.add_argument("--device", dest="device_spec", default="cpu", metavar="cpu|sim[:PROFILE]",
                       help="cpu (default; --gpus picks GPUs), or sim[:PROFILE]: a SIMULATED device for "
                            "benchmarks and tests of the kernel, never for serving: the model's config and "
                            "tokenizer, a real KV pool, and a forward pass that takes a modelled time and "
                            "returns deterministic logits (profiles: h200-1b (default), h200-smollm2, or "
                            "step_ms=..,call_us=..,token_us=..,kv_ns=..; docs/guide/benchmarks.md)")
        p.add_argument("--kv-memory-mb", type=int, default=256, help="KV page pool size in MiB (default 256)")
        p.add_argument("--page-size", type=int, default=16, help="positions per KV page (default 16)")
        p.add_argument("--dtype", default=None, choices=list(DTYPE_NAMES),
                       help="weights, activations and KV pool (default float32 on a CPU, bfloat16 on a GPU)")
        p.add_argument("--kv-dtype", default="auto", choices=["auto", *DTYPE_NAMES],
                       help="the KV pool's dtype (default auto: bfloat16 with --activations int8 on a CPU, "
                            "--dtype's otherwise); on a CPU a float32 engine may keep a bfloat16 or float16 pool: "
                            "half the memory a token's K and V take and half the bytes a decode step's attention "
                            "reads, with K and V rounded as they are written")
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
                            "move by ~4%% of their scale, as llama.cpp's do; on AMX CPUs products of 64 rows and "
                            "more, prefills, multiply in bfloat16, and so does a prompt chunk's attention; the KV pool is "
                            "bfloat16 unless --kv-dtype says otherwise)")
        p.add_argument("--kv-commit", default="background", choices=["background", "lazy"],
                       help="the KV pool's memory in host RAM: background (default) commits all of it on a "
                            "thread of its own once the engine serves, so that no step pays for a page's first "
                            "write (slow on virtual machines); lazy commits each page as a step first writes it "
                            "(a large pool costs RAM only as it fills)")
        p.add_argument("--no-cuda-graphs", action="store_true",
                       help="run decode steps eagerly instead of replaying captured CUDA graphs (GPU only)")
        g = p.add_argument_group("tensor parallelism (one model across processes, GPUs or machines)")
        g.add_argument("--tp", type=int, default=None, metavar="N",
                       help="split the model over N ranks on the CPU (torch.distributed with gloo); "
                            "with --gpus 0,1,... the ranks are the GPUs (NCCL)")
        g.add_argument("--tp-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="how long a collective waits for a rank before the kernel shuts down (default 60)")
        g.add_argument("--nnodes", type=int, default=1, help="machines the ranks span (default 1)")
        g.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 runs the kernel")
        g.add_argument("--master-addr", default=None, help="address of node 0 (with --nnodes > 1)")
        g.add_argument("--master-port", type=int, default=None, help="its rendezvous port (default 29500)")
        g.add_argument("--worker", action="store_true",
                       help="symphony-kernel only: run this machine's tensor-parallel ranks for node 0's kernel "
                            "(with --tp or --gpus, --nnodes, --node-rank, --master-addr, --master-port and node "
                            "0's engine flags)")
        g.add_argument("--rendezvous", default="auto", choices=["auto", "env"],
                       help="auto (default): rank 0 starts this machine's ranks (and meets other machines' "
                            "at --master-addr); env: a launcher such as torchrun started every rank and set "
                            "MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK; RANK 0 is the kernel, "
                            "--gpus lists this machine's GPUs (LOCAL_RANK picks one)")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        """The engine's flags out of a namespace parsed with `add_cli_args`'s flags (others ignored)."""
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})

    def sim_profile(self):
        """The simulated device's `sim.SimProfile` (None: a real device); ConfigError if the flags
        ask for a simulated device with GPUs or tensor parallelism, or name no such profile."""
        from .config import ConfigError
        if self.device_spec == "cpu":
            return None
        from .sim import parse_profile
        profile = parse_profile(self.device_spec)
        if self.gpus:
            raise ConfigError(f"--device {self.device_spec} simulates the device: it takes no --gpus")
        if (self.tp or 1) > 1 or self.nnodes > 1:
            raise ConfigError(f"--device {self.device_spec}: a simulated device runs no tensor parallelism")
        return profile

    def launch_plan(self, cuda_count: Optional[int] = None):
        """Where the ranks run (`tp.plan.LaunchPlan`), checked: ConfigError names the flag.
        ``cuda_count``: the CUDA devices this machine has, to check --gpus against (None:
        unchecked, for tests of the flags alone)."""
        from .tp.plan import launch_plan
        return launch_plan(gpus=self.gpus, tp=self.tp, nnodes=self.nnodes, node_rank=self.node_rank,
                           master_addr=self.master_addr, master_port=self.master_port,
                           rendezvous=self.rendezvous, worker=self.worker, cuda_count=cuda_count)

    def check(self) -> None:
        """Every engine flag checked against this machine (its CUDA devices) and each
        other, before anything loads: ConfigError names the flag."""
        if not 0 < self.tp_timeout <= 3600:
            from .config import ConfigError
            raise ConfigError(f"--tp-timeout must be in (0, 3600] seconds, got {self.tp_timeout}")
        cuda = None
        if self.gpus:
            import torch
            cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.launch_plan(cuda)
        self.sim_profile()
        self.to_config()

    def devices(self) -> list[str]:
        """The torch devices ``--gpus`` names, one per local rank (["cpu"] without it); ConfigError if bad."""
        from .tp.plan import parse_gpus
        ids = parse_gpus(self.gpus)
        return [f"cuda:{i}" for i in ids] if ids else ["cpu"]

    def device(self) -> str:
        """This process's torch device (rank 0's, or with --rendezvous env its own rank's)."""
        return self.launch_plan().device if self.rendezvous == "env" else self.devices()[0]

    def tp_size(self) -> int:
        """Tensor-parallel ranks: --tp, or one per --gpus index on each of --nnodes machines
        (1: no tensor parallelism); ConfigError when the flags disagree or are out of range."""
        from .config import ConfigError
        if not 0 < self.tp_timeout <= 3600:
            raise ConfigError(f"--tp-timeout must be in (0, 3600] seconds, got {self.tp_timeout}")
        return self.launch_plan().size

    def to_config(self) -> "EngineConfig":
        """The validated `EngineConfig` the flags describe (ConfigError names what is wrong)."""
        from .config import DTYPES, EngineConfig
        sim = self.sim_profile() is not None
        dtype = self.dtype or ("bfloat16" if sim else None)     # a simulated GPU's pool: bfloat16, in host memory
        kv = self.kv_dtype_name(dtype, sim)
        return EngineConfig(device=self.device(), dtype=DTYPES[dtype] if dtype else None,
                            kv_dtype=DTYPES[kv] if kv else None, page_size=self.page_size,
                            kv_memory_bytes=self.kv_memory_mb * 2**20,
                            cuda_graphs=False if self.no_cuda_graphs or sim else None,
                            weights=self.weights, quantize=self.quantize, kv_commit=self.kv_commit)

    def kv_dtype_name(self, dtype: Optional[str], sim: bool) -> Optional[str]:
        """--kv-dtype resolved (None: the engine's dtype). auto: bfloat16 for ``--activations
        int8`` on a CPU with float32 activations, whose logits already move by a few percent
        (bfloat16 K and V move them by up to ~0.6 % of their scale; perf/RESULTS.md), else the engine's."""
        if self.kv_dtype != "auto":
            return self.kv_dtype
        if self.activations == "int8" and not self.gpus and not sim and (dtype or "float32") == "float32":
            return "bfloat16"
        return None

    def load(self, cfg: "Optional[EngineConfig]" = None):
        """Select the CPU kernels ``--activations`` asks for and load the model into an `Engine`
        run as ``cfg`` (default: `to_config`), across `tp_size` ranks (the others started here
        and, with --nnodes, on the other machines, or by a launcher).  ConfigError,
        ModelLoadError (engine/loader.py), TPFailure (a rank could not start) or
        tp.agree.TPMismatch (the ranks' settings disagree)."""
        from .engine import Engine
        from .quant import set_int8_activations
        from .config import ConfigError
        if self.is_other_rank():
            raise ConfigError("this process runs tensor-parallel ranks for another kernel (--worker, or a "
                              "launcher's RANK other than 0): symphony-kernel serves those")
        cfg = self.to_config() if cfg is None else cfg
        profile = self.sim_profile()
        if profile is not None:
            from .sim import SimEngine
            return SimEngine.load(self.model, cfg, profile)
        set_int8_activations(self.activations == "int8")
        plan = self.launch_plan()
        if plan.size == 1:
            return Engine.load(self.model, cfg)
        from .loader import read_model_config
        from .tp.launch import TensorParallel
        tp = TensorParallel.start(self.model, cfg, plan.size, read_model_config(self.model),
                                  timeout_s=self.tp_timeout, activations=self.activations, plan=plan)
        try:
            return Engine.load(self.model, cfg, tp=tp)
        except BaseException:
            tp.group.broken = tp.group.broken or "rank 0 failed to load its shard"
            tp.close(grace_s=1.0)
            raise

    def is_other_rank(self) -> bool:
        """Whether this process runs ranks but not the kernel: ``--worker``, or a rank
        other than 0 under ``--rendezvous env``."""
        return self.worker or (self.rendezvous == "env" and self.launch_plan().rank != 0)

    def run_other_ranks(self) -> int:
        """``symphony-kernel --worker`` (this machine's ranks, --node-rank k of --nnodes) or a
        launcher's rank other than 0: serve until node 0's kernel stops them; the exit status
        of the first that fails, else 0."""
        from .tp.launch import run_node, serve_env_rank
        plan = self.launch_plan()
        if self.rendezvous == "env":
            return serve_env_rank(self.model, self.to_config(), plan, self.tp_timeout, self.activations)
        return run_node(self.model, self.to_config(), plan, self.tp_timeout, self.activations)
