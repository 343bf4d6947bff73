"""Loading GGUF files and Hugging Face directories; tokenizers from metadata."""
import json

import numpy as np
import pytest
import torch

from modelfiles import (TINY_VOCAB_SIZE, hf_state_dict, tiny_hf_config, write_gguf,
                        write_hf_dir)
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine
from symphony.engine.loader import ModelLoadError, load_model
from symphony.engine.reference import ReferenceLlama
from symphony.tokenizer import Tokenizer

PROMPT = list(range(3, 40, 2))


def run(weights, tokens=PROMPT):
    eng = Engine(weights, None, EngineConfig(page_size=4, num_pages=64))
    return eng.pred(eng.new_sequence(), tokens, all_logits=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_and_hf_dir_of_the_same_weights_agree(tmp_path, arch):
    over = {"architectures": ["Qwen2ForCausalLM"], "attention_bias": True} if arch == "qwen2" else {}
    cfg = tiny_hf_config(**over)
    sd = hf_state_dict(cfg)
    gguf_w, tok = load_model(write_gguf(tmp_path / "m.gguf", cfg, sd, arch=arch), progress=False)
    hf_w, hf_tok = load_model(write_hf_dir(tmp_path / "hf", cfg, sd, tok), progress=False)
    assert gguf_w.config.arch == hf_w.config.arch == arch
    assert gguf_w.config.attn_bias == (arch == "qwen2")
    a, b = run(gguf_w), run(hf_w)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(a, ReferenceLlama(hf_w).forward(PROMPT), atol=1e-4, rtol=0)
    assert hf_tok.encode("the theory") == tok.encode("the theory")


def test_hf_weights_match_an_independent_rotate_half_forward(tmp_path):
    """Our interleaved-RoPE layout must equal Hugging Face's rotate-half math on
    the original (unpermuted) weights: check layer 0's attention scores."""
    cfg = tiny_hf_config(num_hidden_layers=1)
    sd = hf_state_dict(cfg)
    w, _ = load_model(write_hf_dir(tmp_path / "hf", cfg, sd), progress=False)
    x = torch.randn(5, 64)
    nh, d = 4, 16
    pos = torch.arange(5, dtype=torch.float32)
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2) / d)
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)[:, None, :]      # HF: [n, 1, d]

    def rot_half(t):
        return torch.cat((-t[..., d // 2:], t[..., : d // 2]), dim=-1)
    q = (x @ sd["model.layers.0.self_attn.q_proj.weight"].t()).view(5, nh, d)
    k = (x @ sd["model.layers.0.self_attn.k_proj.weight"].t()).view(5, 2, d).repeat_interleave(2, 1)
    q, k = q * ang.cos() + rot_half(q) * ang.sin(), k * ang.cos() + rot_half(k) * ang.sin()
    want = torch.einsum("qhd,khd->hqk", q, k)
    ref = ReferenceLlama(w)
    qkv = x @ w.layers[0].wqkv.t()
    q2 = ref._rope(qkv[:, :64].view(5, nh, d), pos.long())
    k2 = ref._rope(qkv[:, 64:96].view(5, 2, d), pos.long()).repeat_interleave(2, 1)
    torch.testing.assert_close(torch.einsum("qhd,khd->hqk", q2, k2), want, atol=1e-4, rtol=1e-4)


def test_quantized_gguf_dequantizes_close_to_float(tmp_path):
    cfg = tiny_hf_config()
    sd = hf_state_dict(cfg)
    f32, _ = load_model(write_gguf(tmp_path / "f.gguf", cfg, sd), progress=False)
    q8, _ = load_model(write_gguf(tmp_path / "q.gguf", cfg, sd, quant="Q8_0"), progress=False)
    err = (q8.layers[0].wqkv.dequantize() - f32.layers[0].wqkv).abs().max()  # kept quantized
    assert 0 < err < 2e-3                                # quantized, and by Q8_0's step size
    a, b = run(f32), run(q8)
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_tokenizer_from_gguf_metadata(tmp_path):
    cfg = tiny_hf_config()
    _, tok = load_model(write_gguf(tmp_path / "m.gguf", cfg, hf_state_dict(cfg)), progress=False)
    assert tok.vocab_size == TINY_VOCAB_SIZE and tok.bos_id == 1 and tok.eos_ids == (2,)
    ids = tok.encode("the theme")
    assert ids[0] == tok.token_to_id("he") - 1 or tok.decode(ids) == "the theme"
    assert tok.token_to_id("Ġthe") in ids                 # the merges are used
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat = tok.encode(text)
    assert chat[0] == 1 and chat.count(2) == 1            # special tokens map to their ids
    clone = Tokenizer.from_json(tok.to_json())
    assert clone.encode(text) == chat and clone.eos_ids == tok.eos_ids
    assert clone.apply_chat_template([{"role": "user", "content": "hi"}]) == text


def test_chat_template_is_sandboxed_and_validates_messages(tmp_path):
    cfg = tiny_hf_config()
    _, tok = load_model(write_gguf(tmp_path / "m.gguf", cfg, hf_state_dict(cfg),
                                   chat_template="{{ messages.__class__.__mro__ }}"), progress=False)
    from jinja2.exceptions import SecurityError
    with pytest.raises((SecurityError, Exception)):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    _, tok = load_model(write_gguf(tmp_path / "n.gguf", cfg, hf_state_dict(cfg)), progress=False)
    with pytest.raises(ValueError, match="chat message"):
        tok.apply_chat_template([{"role": "user"}])


# ---------------------------------------------------------------- clear errors

def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")


def test_garbage_file(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"this is not a model" * 10)
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        load_model(p)
    q = tmp_path / "weights.bin"
    q.write_bytes(b"\0" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(q)


def test_truncated_gguf(tmp_path):
    cfg = tiny_hf_config()
    p = write_gguf(tmp_path / "m.gguf", cfg, hf_state_dict(cfg))
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=str(p.name)):
        load_model(p)


def test_unsupported_architecture(tmp_path):
    import gguf
    p = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(p), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(p)
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(d)


def test_hf_dir_problems(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(d)
    cfg = tiny_hf_config()
    sd = hf_state_dict(cfg)
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight.*missing"):
        load_model(write_hf_dir(tmp_path / "hf", cfg, sd))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ModelLoadError, match="corrupt safetensors"):
        load_model(tmp_path / "hf")
    sd = hf_state_dict(cfg)
    write_hf_dir(tmp_path / "hf2", cfg, sd)
    (tmp_path / "hf2" / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json is missing"):
        load_model(tmp_path / "hf2")


def test_wrong_shape_is_named(tmp_path):
    cfg = tiny_hf_config()
    sd = hf_state_dict(cfg)
    sd["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 95)
    with pytest.raises(ModelLoadError, match="down_proj.*shape"):
        load_model(write_hf_dir(tmp_path / "hf", cfg, sd))


def test_hf_config_rope_in_both_transformers_formats():
    """transformers < 5 writes rope_theta + rope_scaling; 5 writes rope_parameters.
    Both must give the same RoPE (a silent theta of 10000 ruins every logit)."""
    from symphony.engine.loader import ModelLoadError, hf_config_to_model_config
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    old = hf_config_to_model_config({**base, "rope_theta": 500000.0, "rope_scaling": scaling})
    new = hf_config_to_model_config({**base, "rope_parameters": {"rope_theta": 500000.0, **scaling}})
    plain = hf_config_to_model_config({**base, "rope_parameters": {"rope_type": "default",
                                                                   "rope_theta": 250000.0}})
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.rope_scaling == new.rope_scaling and new.rope_scaling.kind == "llama3"
    assert new.rope_scaling.factor == 32.0
    assert plain.rope_theta == 250000.0 and plain.rope_scaling.kind == "none"
    with pytest.raises(ModelLoadError, match="rope_parameters"):
        hf_config_to_model_config({**base, "rope_parameters": [1, 2]})


def _same_file_as_the_package_reads_it(path):
    import gguf
    from symphony.engine.gguf_reader import reader_class
    ours, theirs = reader_class()(str(path)), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for name, f in theirs.fields.items():
        g = ours.fields[name]
        assert (g.offset, g.name, g.types) == (f.offset, f.name, f.types), name
        assert g.contents() == f.contents(), name
        assert len(g.data) == len(f.data), name
        if g.data and g.data != [-1]:
            assert g.contents(len(g.data) - 1) == f.contents(len(f.data) - 1), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.n_bytes, a.data_offset) == (b.tensor_type, b.n_bytes, b.data_offset)
        assert list(a.shape) == list(b.shape) and np.array_equal(a.data, b.data), a.name
    return ours


def test_the_fast_gguf_reader_reads_what_the_package_reads(tmp_path):
    import gguf
    cfg = tiny_hf_config()
    p = write_gguf(tmp_path / "m.gguf", cfg, hf_state_dict(cfg))
    _same_file_as_the_package_reads_it(p)
    # every array element type, empty arrays and non-ASCII strings
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    w.add_array("t.str", ["", "é€", "a" * 300])
    w.add_array("t.empty", [])
    w.add_array("t.f32", [1.5, -2.25])
    w.add_array("t.i32", [-1, 7, 2**31 - 1])
    w.add_array("t.bool", [True, False])
    w.add_key_value("t.u64", [2**63 + 5], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT64)
    w.add_key_value("t.i8", [-128, 127], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT8)
    w.add_tensor("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = _same_file_as_the_package_reads_it(tmp_path / "a.gguf")
    assert r.fields["t.str"].contents() == ["", "é€", "a" * 300]
    assert r.fields["t.u64"].contents() == [2**63 + 5]


def test_the_embedded_model_reads_as_the_package_reads_it():
    from symphony.engine.loader import default_model_path
    r = _same_file_as_the_package_reads_it(default_model_path())
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 49152


def test_an_array_running_past_the_file_is_a_load_error(tmp_path):
    cfg = tiny_hf_config()
    p = write_gguf(tmp_path / "m.gguf", cfg, hf_state_dict(cfg))
    data = bytearray(p.read_bytes())
    at = data.find(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4   # the count
    data[at:at + 8] = (2**40).to_bytes(8, "little")
    p.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        load_model(p)
