"""Write tiny model files (GGUF and Hugging Face safetensors directories) with
known random weights, to test the loaders without downloading anything."""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHAT_TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
                 "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


def byte_unicode() -> list[str]:
    """GPT-2's byte -> printable unicode map, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tiny_vocab() -> list[str]:
    return SPECIALS + byte_unicode() + ["Ġt", "he", "Ġthe"]


TINY_VOCAB_SIZE = len(SPECIALS) + 256 + len(MERGES)  # 262


def hf_state_dict(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with Hugging Face Llama names and layout (rotate-half q/k)."""
    g = torch.Generator().manual_seed(seed)
    h, f, nh, nkv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // nh
    r = lambda *s, scale=0.08: torch.randn(*s, generator=g) * scale
    sd = {"model.embed_tokens.weight": r(cfg["vocab_size"], h, scale=1.0),
          "model.norm.weight": 1 + r(h, scale=0.1)}
    if not cfg.get("tie_word_embeddings"):
        sd["lm_head.weight"] = r(cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": 1 + r(h, scale=0.1),
                   p + "post_attention_layernorm.weight": 1 + r(h, scale=0.1),
                   p + "self_attn.q_proj.weight": r(nh * d, h), p + "self_attn.k_proj.weight": r(nkv * d, h),
                   p + "self_attn.v_proj.weight": r(nkv * d, h), p + "self_attn.o_proj.weight": r(h, nh * d),
                   p + "mlp.gate_proj.weight": r(f, h), p + "mlp.up_proj.weight": r(f, h),
                   p + "mlp.down_proj.weight": r(h, f)})
        if cfg.get("attention_bias"):
            sd.update({p + "self_attn.q_proj.bias": r(nh * d), p + "self_attn.k_proj.bias": r(nkv * d),
                       p + "self_attn.v_proj.bias": r(nkv * d)})
    return sd


def tiny_hf_config(**over) -> dict:
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=TINY_VOCAB_SIZE, hidden_size=64,
               intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
               tie_word_embeddings=False)
    cfg.update(over)
    return cfg


def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp's convert script: rotate-half rows -> interleaved rows, per head
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape))


K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _tensor_quant(quant: str | None, name: str) -> str | None:
    """The GGUF type of matrix ``name`` under ``quant``: one type for every matrix, or
    "Q4_K_M" (llama.cpp's mix: Q6_K for attn_v, ffn_down and the output head, Q4_K elsewhere)."""
    if quant == "Q4_K_M":
        return "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K"
    return quant


def write_gguf(path: Path, cfg: dict, sd: dict[str, torch.Tensor], *, arch: str = "llama",
               quant: str | None = None, chat_template: str = CHAT_TEMPLATE) -> Path:
    """A GGUF file of ``sd``. ``quant``: a GGUF type for every matrix (Q8_0 / Q4_0 / Q4_1 are
    quantized from the weights; the K-quants and "Q4_K_M" get random blocks instead, and
    matrices whose rows are not a multiple of 256 stay float32)."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_name("tiny-test")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    vocab = tiny_vocab()
    w.add_token_list(vocab)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(chat_template)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
           "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
           "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
           "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
           "self_attn.v_proj.bias": "attn_v.bias",
           "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
           "mlp.down_proj.weight": "ffn_down.weight"}
    for k, t in sd.items():
        if k.startswith("model.layers."):
            _, _, i, rest = k.split(".", 3)
            name = f"blk.{i}.{per[rest]}"
            if arch == "llama" and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                t = _llama_cpp_permute(t, nh if "q_proj" in rest else nkv)
        else:
            name = names[k]
        arr = t.numpy().astype(np.float32)
        qtype = _tensor_quant(quant, name) if arr.ndim == 2 else None
        if qtype in K_QUANTS and arr.shape[1] % 256 == 0:
            # the gguf package has no K-quant quantizer: random blocks, seeded by the name
            qt = getattr(gguf.GGMLQuantizationType, qtype)
            raw = random_gguf_blocks(qtype, arr.shape[0], arr.shape[1], seed=zlib.crc32(name.encode()),
                                     d=2e-4)
            w.add_tensor(name, raw, raw_dtype=qt)
        elif qtype and qtype not in K_QUANTS:
            qt = getattr(gguf.GGMLQuantizationType, qtype)
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_tokenizer():
    """The tiny byte-level BPE tokenizer, built the way a GGUF file's is."""
    from symphony.tokenizer import Tokenizer
    vocab = tiny_vocab()
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": vocab, "tokenizer.ggml.merges": MERGES,
            "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.chat_template": CHAT_TEMPLATE}
    return Tokenizer.from_gguf_fields(lambda k, d=None: meta.get(k, d), Path("tiny"))


def write_hf_dir(path: Path, cfg: dict, sd: dict[str, torch.Tensor], tokenizer=None) -> Path:
    from safetensors.torch import save_file
    tokenizer = tokenizer or tiny_tokenizer()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    tokenizer._tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    return path


# Byte offsets of the float16 fields (d, dmin) in one block of each GGUF quant type, and the
# block's (weights, bytes). Every other bit pattern of a block is a valid encoding.
GGUF_BLOCKS = {"Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q8_0": (32, 34, (0,)),
               "Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,))}


def random_gguf_blocks(qtype: str, n: int, k: int, seed: int = 0, d: float = 0.01) -> np.ndarray:
    """Random raw blocks of a GGUF quant type ([n, k / block * bytes] uint8): random quants and
    sub-block scales, float16 d / dmin fields drawn from [0.25 d, d] (finite, so every weight is).
    A test-side encoder for the types the ``gguf`` package cannot quantize (the K-quants)."""
    qk, bb, f16_offsets = GGUF_BLOCKS[qtype]
    assert k % qk == 0, (qtype, k)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // qk, bb), dtype=np.uint8)
    for off in f16_offsets:
        vals = rng.uniform(0.25 * d, d, size=(n, k // qk)).astype(np.float16)
        blocks[:, :, off:off + 2] = vals.view(np.uint8).reshape(n, k // qk, 2)
    return blocks.reshape(n, -1)


def write_tiny_gguf(directory: Path, seed: int = 0, **over) -> Path:
    """A tiny random Llama as a GGUF file in ``directory`` (tiny_hf_config with ``over``)."""
    cfg = tiny_hf_config(**over)
    return write_gguf(Path(directory) / "tiny.gguf", cfg, hf_state_dict(cfg, seed=seed))
