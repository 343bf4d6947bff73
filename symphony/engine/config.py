"""Validated configuration objects, passed into constructors.

`ModelConfig` describes a Llama-family decoder (read from a GGUF header or a
Hugging Face ``config.json``); `EngineConfig` describes how the engine runs it
(device, dtype, KV page pool).  Both validate themselves on construction, so a
bad value fails at start-up with a message naming the field, not deep inside a
forward pass.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch


class ConfigError(ValueError):
    """A configuration value is missing or out of range."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.  ``kind`` is ``"none"``, ``"linear"`` or ``"llama3"``."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context_length: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("none", "linear", "llama3"):
            raise ConfigError(f"unsupported rope scaling type {self.kind!r} "
                              "(supported: none, linear, llama3)")
        if self.factor <= 0:
            raise ConfigError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder."""

    arch: str                 # "llama", "qwen2", "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_context: int = 4096
    tie_embeddings: bool = False
    attn_bias: bool = False   # Qwen2 has biases on q, k, v
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "n_layers",
                  "n_heads", "n_kv_heads", "head_dim", "max_context"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"model config: {f} must be a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model config: n_heads ({self.n_heads}) is not a multiple "
                              f"of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_eps > 0:
            raise ConfigError(f"model config: rms_eps must be > 0, got {self.rms_eps}")

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


WEIGHT_MODES = ("auto", "quantized", "float")
KV_COMMIT = ("lazy", "background")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name as DTYPES, the flags and files spell it: ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on the CPU, bfloat16 on a GPU.

    Every device runs all three dtypes (weights, activations and KV pool alike;
    logits always come out of a float32 head).  float32 stays the CPU default:
    it matches the float32 reference, where bfloat16 moves SmolLM2's logits by
    up to ~4% of their scale and flips near-tie greedy choices, and bfloat16's
    speed-up on the CPU is for batched decode only (perf/RESULTS.md, "Reduced
    precision on the CPU").
    """
    return torch.float32 if device.type == "cpu" else torch.bfloat16


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model.

    The KV pool holds ``num_pages`` pages of ``page_size`` positions each (K and
    V for every layer).  Give ``num_pages`` directly, or leave it ``None`` and
    give ``kv_memory_bytes``; page 0 is reserved as the null page.
    """

    device: str = "cpu"
    dtype: Optional[torch.dtype] = None  # float32 / bfloat16 / float16; None: default_dtype(device)
    # The KV pool's dtype; None: `dtype`'s. On the CPU a float32 engine may keep a bfloat16 or
    # float16 pool (half the bytes a decode step's attention reads; K and V rounded as written).
    kv_dtype: Optional[torch.dtype] = None
    page_size: int = 16
    num_pages: Optional[int] = None
    kv_memory_bytes: int = 512 * 1024 * 1024
    max_seq_len: Optional[int] = None   # slots per KV file; default: model context
    max_batch_tokens: int = 8192        # tokens one forward pass may carry
    # Decode steps (every call one token) through static, padded buffers replayed
    # as CUDA graphs.  None: on for CUDA devices, off on the CPU.  True on the CPU
    # runs the same padded static-buffer path eagerly (no capture): tests use it.
    cuda_graphs: Optional[bool] = None
    graph_max_batch: int = 128          # largest decode batch with a graph
    # lm_head (and the final norm) in float32 whatever `dtype` is.  None: on for the
    # CPU, off on a GPU, where the float32 copy of lm_head would be read every step
    # (for a 1B model with a 128k vocabulary, +20% bytes a decode step).
    float32_head: Optional[bool] = None
    # Quantized matrices: "quantized" keeps a GGUF file's quantized tensors in memory, in their
    # own bits, and computes with them (symphony/engine/quant.py); "float" dequantizes them to
    # `dtype` at load; "auto": quantized on the CPU (faster and ~5x smaller, perf/RESULTS.md),
    # float on a GPU.
    weights: str = "auto"
    # "int8" / "int4": quantize float matrices (a safetensors checkpoint, F16/F32 GGUF tensors)
    # at load, groups of 32; None: keep them float.
    quantize: Optional[str] = None
    # The host KV pool's memory: "lazy" commits a page when a step first writes it;
    # "background" commits it all on a thread of its own once the engine serves
    # (`KVPool.start_commit`), so that no step pays for that (the kernel's default).
    kv_commit: str = "lazy"

    def __post_init__(self) -> None:
        try:
            dev = torch.device(self.device)
        except RuntimeError as e:
            raise ConfigError(f"engine config: bad device {self.device!r}: {e}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"engine config: device {self.device!r} asked for, "
                              "but torch sees no CUDA device")
        if not isinstance(self.page_size, int) or not 1 <= self.page_size <= 1024:
            raise ConfigError(f"engine config: page_size must be in 1..1024, got {self.page_size!r}")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
            raise ConfigError(f"engine config: num_pages must be >= 2, got {self.num_pages!r}")
        if self.kv_memory_bytes <= 0:
            raise ConfigError("engine config: kv_memory_bytes must be > 0")
        if self.max_batch_tokens < 1:
            raise ConfigError("engine config: max_batch_tokens must be >= 1")
        if self.cuda_graphs not in (None, True, False):
            raise ConfigError(f"engine config: cuda_graphs must be None, True or False, got {self.cuda_graphs!r}")
        if self.float32_head not in (None, True, False):
            raise ConfigError(f"engine config: float32_head must be None, True or False, got {self.float32_head!r}")
        if not isinstance(self.graph_max_batch, int) or not 1 <= self.graph_max_batch <= 4096:
            raise ConfigError(f"engine config: graph_max_batch must be in 1..4096, got {self.graph_max_batch!r}")
        if self.weights not in WEIGHT_MODES:
            raise ConfigError(f"engine config: weights must be one of {', '.join(WEIGHT_MODES)}, "
                              f"got {self.weights!r}")
        if self.quantize not in (None, "int8", "int4"):
            raise ConfigError(f"engine config: quantize must be None, 'int8' or 'int4', got {self.quantize!r}")
        if self.quantize is not None and self.weights == "float":
            raise ConfigError("engine config: quantize=... needs weights 'quantized' or 'auto', not 'float'")
        if self.kv_commit not in KV_COMMIT:
            raise ConfigError(f"engine config: kv_commit must be one of {', '.join(KV_COMMIT)}, got {self.kv_commit!r}")
        if self.dtype is not None and self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ConfigError(f"engine config: dtype must be float32, float16 or bfloat16, got {self.dtype}")
        if self.kv_dtype is not None and self.kv_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ConfigError(f"engine config: kv_dtype must be float32, float16 or bfloat16, got {self.kv_dtype}")
        kv, act = self.torch_kv_dtype, self.torch_dtype
        if kv != act:
            if dev.type != "cpu":
                raise ConfigError(f"engine config: a KV pool of {dtype_name(kv)} beside {dtype_name(act)} activations "
                                  "runs on the CPU only; on a GPU the pool has the engine's dtype")
            if act != torch.float32:
                raise ConfigError(f"engine config: a KV pool of {dtype_name(kv)} needs float32 activations, not "
                                  f"{dtype_name(act)} (the pool may be narrower than the activations, not wider "
                                  "or of another 16-bit kind)")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def use_float32_head(self) -> bool:
        if self.float32_head is None:
            return self.torch_device.type == "cpu"
        return self.float32_head

    @property
    def use_graphs(self) -> bool:
        """Whether decode steps take the static padded (graph) path."""
        if self.cuda_graphs is None:
            return self.torch_device.type == "cuda"
        return self.cuda_graphs

    @property
    def keep_quantized(self) -> bool:
        """Whether matrices stay quantized in memory (``weights`` resolved for the device)."""
        if self.weights == "auto":
            return self.torch_device.type == "cpu" or self.quantize is not None
        return self.weights == "quantized"

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype or default_dtype(self.torch_device)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """The KV pool's dtype: ``kv_dtype``, else the engine's."""
        return self.kv_dtype or self.torch_dtype

    def page_bytes(self, model: ModelConfig) -> int:
        """Bytes of one page: K and V of page_size positions for every layer."""
        elem = torch.tensor([], dtype=self.torch_kv_dtype).element_size()
        return 2 * model.n_layers * self.page_size * model.kv_size * elem

    def resolve_num_pages(self, model: ModelConfig) -> int:
        if self.num_pages is not None:
            return self.num_pages
        return max(2, self.kv_memory_bytes // self.page_bytes(model))
