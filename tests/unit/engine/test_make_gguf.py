"""perf/make_gguf.py, the random Llama GGUF writer: its K-quant encoders against the ``gguf``
package's dequantizer; the tiny shape in each type loads in our loader with the types it says,
gives finite logits equal to the plain PyTorch reference on the same dequantized weights, and
loads in llama.cpp (when llama-cpp-python is installed) with the same tokens and close logits.

Tolerances, as tests/e2e/model/test_quant_engine.py states them: on a forced float-activation
path the engine and the float32 reference differ only in the order of float32 sums, 1e-4 of the
logits' scale; the automatic choice rounds activations to 15 bits on some CPUs, 1e-3. llama.cpp
rounds every matrix's input to 8 bits (and keeps K/V in float16): within 0.1 of the scale, the
bound stated there for int8-rounded activations on tiny random models (measured ~1.3e-2).
"""
import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine
from symphony.engine.quant import QWeight, force_qlinear_path
from symphony.engine.reference import ReferenceLlama

from .test_quant import AUTO_15BIT, HAS_AVX2, HAS_AVX512

FLOAT_PATH = 2 if HAS_AVX512 else 1 if HAS_AVX2 else 0      # the fastest float-activation kernel
AUTO_TOL = 1e-3 if AUTO_15BIT else 1e-4
TEXT = "Hello world, this is a test of the tokenizer with some words."

_spec = importlib.util.spec_from_file_location(
    "make_gguf", Path(__file__).resolve().parents[3] / "perf" / "make_gguf.py")
make_gguf = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("make_gguf", make_gguf)               # dataclasses look their module up
_spec.loader.exec_module(make_gguf)


@pytest.mark.parametrize("qtype, rel_rms", [("Q4_K", 0.1), ("Q6_K", 0.03)])
def test_k_quant_encoders_match_the_gguf_dequantizer(qtype, rel_rms):
    x = np.random.default_rng(0).standard_normal((8, 512), dtype=np.float32) * 0.02
    x[1] = 0.0                                    # an all-zero row: no division by zero
    x[2] = np.abs(x[2])                           # no negative value: the min is 0
    raw = make_gguf.quantize(x, qtype)
    qk, bb = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, qtype)]
    assert raw.dtype == np.uint8 and raw.shape == (8, 512 // qk * bb)
    y = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype)).reshape(x.shape)
    assert np.isfinite(y).all() and not y[1].any()
    assert np.sqrt(((y - x) ** 2).mean()) <= rel_rms * x.std()


def test_q4_k_m_mix_follows_llama_cpp():
    types = {t.name: t.qtype for t in make_gguf.plan(make_gguf.SHAPES["1b"], "Q4_K_M")}
    assert types["token_embd.weight"] == "Q6_K"
    six = [i for i in range(16) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert six == [0, 1, 4, 7, 10, 13, 14, 15]
    assert all(types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] for i in range(16))
    assert {types[f"blk.{i}.{m}.weight"] for i in range(16)
            for m in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {"Q4_K"}
    assert types["blk.0.attn_norm.weight"] is None


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("make_gguf")
    return {t: make_gguf.write_gguf(d / f"tiny-{t}.gguf", "tiny", t, progress=False)
            for t in make_gguf.TYPES}


@pytest.mark.parametrize("qtype", make_gguf.TYPES)
def test_tiny_loads_and_matches_the_reference(tiny_files, qtype):
    path = tiny_files[qtype]
    eng = Engine.load(path, EngineConfig(page_size=4, num_pages=64), progress=False)
    w, shape = eng.model.w, make_gguf.SHAPES["tiny"]
    c = eng.model_config
    assert (c.n_layers, c.hidden_size, c.intermediate_size, c.n_heads, c.n_kv_heads, c.head_dim,
            c.vocab_size) == (shape.n_layers, shape.hidden, shape.intermediate, shape.n_heads,
                              shape.n_kv_heads, shape.head_dim, shape.vocab)
    assert c.tie_embeddings and w.lm_head is w.embed
    want = {"Q4_0": ("Q4_0", "Q4_0", "Q4_0"), "Q8_0": ("Q8_0", "Q8_0", "Q8_0"),
            # 2 layers: layer 1 is in llama.cpp's last eighth, layer 0 is not
            "Q4_K_M": ("Q6_K", "Q4_K", "Q6_K")}[qtype]
    for t in (w.embed, w.layers[0].wqkv, w.layers[1].w_down):
        assert isinstance(t, QWeight)
    assert (w.embed.source, w.layers[0].w_down.source, w.layers[1].w_down.source) == want
    ids = eng.tokenizer.encode(TEXT)
    assert eng.tokenizer.decode(ids) == TEXT
    ref = ReferenceLlama(w).forward(ids)                          # [T, vocab], float32
    scale = ref.abs().max()
    with force_qlinear_path(FLOAT_PATH):
        kv = eng.new_sequence()
        a = eng.pred(kv, ids, all_logits=True)
        eng.release(kv)
    assert torch.isfinite(a).all() and 0.1 < scale < 100
    assert (a - ref).abs().max() <= 1e-4 * scale
    kv = eng.new_sequence()
    b = eng.pred(kv, ids, all_logits=True)                       # the automatic choice
    assert (b - ref).abs().max() <= AUTO_TOL * scale

    try:
        from llama_cpp import Llama
    except ImportError:
        pytest.skip("llama-cpp-python is not installed")
    llm = Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    try:
        assert llm.n_vocab() == shape.vocab
        toks = llm.tokenize(TEXT.encode(), add_bos=False)
        assert toks == ids
        llm.eval(toks)
        lc = torch.from_numpy(np.array(llm.scores[: len(toks)], dtype=np.float32))
        assert torch.isfinite(lc).all()
        assert (lc - ref).abs().max() <= 0.1 * scale
    finally:
        llm.close()
