"""A KV pool narrower than the activations (``EngineConfig.kv_dtype``, ``--kv-dtype``): a float32
engine on the CPU keeping K and V in bfloat16 or float16.

Against the plain PyTorch reference that stores K and V in the same dtype (rounding them as they
are written, attending in float32): the float32 tolerance, TINY_ATOL (measured <= 4.8e-7 on the
tiny models: only the order of float32 sums differs). Against the float32 reference: the
rounding of K and V moves the tiny models' logits by up to 4.3e-4 (bfloat16) and 5.6e-5
(float16) of logits of ~1.5; the bounds are 10x that."""
import argparse
import os

import pytest
import torch

from conftest import TINY_ATOL, tiny_config
from symphony.engine import quant
from symphony.engine.args import EngineArgs
from symphony.engine.config import ConfigError, EngineConfig
from symphony.engine.engine import Engine, PredRequest
from symphony.engine.reference import ReferenceLlama
from symphony.engine.weights import random_weights
from symphony.kvfs import KVFS, KVFSConfig, Principal

HALF = [torch.bfloat16, torch.float16]
IDS = ["bf16", "fp16"]
FROM_FLOAT32 = {torch.bfloat16: 5e-3, torch.float16: 6e-4}
ALICE = Principal("alice", 1)


def toks(n, seed=0):
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make(kv_dtype, cfg=None, pages=128, page_size=4):
    w = random_weights(cfg or tiny_config(), seed=0)
    return Engine(w, None, EngineConfig(page_size=page_size, num_pages=pages, kv_dtype=kv_dtype)), w


def close(got, w, tokens, kv_dtype):
    """Logits vs the reference storing K/V in kv_dtype (tight) and vs the float32 one (loose)."""
    torch.testing.assert_close(got, ReferenceLlama(w, kv_dtype=kv_dtype).forward(tokens)[-got.shape[0]:],
                               atol=TINY_ATOL, rtol=0)
    r32 = ReferenceLlama(w).forward(tokens)[-got.shape[0]:]
    assert 0 < (got - r32).abs().max() <= FROM_FLOAT32[kv_dtype]            # the rounding is real


def test_config():
    c = EngineConfig(kv_dtype=torch.bfloat16)
    assert c.torch_dtype == torch.float32 and c.torch_kv_dtype == torch.bfloat16
    assert EngineConfig().torch_kv_dtype == torch.float32
    assert EngineConfig(dtype=torch.bfloat16).torch_kv_dtype == torch.bfloat16
    m = tiny_config()
    assert c.page_bytes(m) * 2 == EngineConfig().page_bytes(m)
    # the same memory holds twice the pages
    assert EngineConfig(kv_dtype=torch.float16, kv_memory_bytes=1 << 20).resolve_num_pages(m) == \
        2 * EngineConfig(kv_memory_bytes=1 << 20).resolve_num_pages(m)
    with pytest.raises(ConfigError, match="kv_dtype must be float32, float16 or bfloat16"):
        EngineConfig(kv_dtype=torch.int8)
    with pytest.raises(ConfigError, match="needs float32 activations"):
        EngineConfig(dtype=torch.bfloat16, kv_dtype=torch.float16)
    with pytest.raises(ConfigError, match="needs float32 activations"):
        EngineConfig(dtype=torch.bfloat16, kv_dtype=torch.float32)


@pytest.mark.parametrize("kv_dtype", HALF, ids=IDS)
@pytest.mark.parametrize("cfg", [tiny_config(), tiny_config(n_kv_heads=4),
                                 tiny_config(n_heads=6, n_kv_heads=2, head_dim=8, hidden_size=48)],
                         ids=["gqa2", "mha", "gqa3"])
def test_chunks_and_decodes_match_the_reference(kv_dtype, cfg):
    eng, w = make(kv_dtype, cfg)
    assert eng.kv.pool.dtype == kv_dtype and eng.model.w.layers[0].wqkv.dtype == torch.float32
    t = toks(40)
    kv = eng.new_sequence()
    got, at = [], 0
    for n in (1, 7, 16, 3, 1, 1, 5, 6):
        got.append(eng.pred(kv, t[at:at + n], all_logits=True))
        at += n
    got = torch.cat(got)
    assert got.dtype == torch.float32
    close(got, w, t, kv_dtype)


def test_the_layer_stack_and_the_python_loop_agree():
    """The one-op layer stack (C++) and the Python loop write and read the bfloat16 pool alike."""
    eng, w = make(torch.bfloat16)
    loop, _ = make(torch.bfloat16)
    assert eng.model.layer_stack is not None
    loop.model.layer_stack = None
    t = toks(30, seed=3)
    a, b = eng.new_sequence(), loop.new_sequence()
    torch.testing.assert_close(eng.pred(a, t[:20], all_logits=True), loop.pred(b, t[:20], all_logits=True),
                               atol=1e-5, rtol=0)
    for x in t[20:]:
        torch.testing.assert_close(eng.pred(a, [x]), loop.pred(b, [x]), atol=1e-5, rtol=0)
    assert torch.equal(eng.kv.pool[:, :, a.pages].view(torch.int16), loop.kv.pool[:, :, b.pages].view(torch.int16))


def test_a_batch_equals_its_members_alone_and_a_fork_copies_bits():
    eng, w = make(torch.bfloat16, pages=256)
    alone, _ = make(torch.bfloat16, pages=256)
    hist = [toks(n, seed=i) for i, n in enumerate((1, 9, 17, 30))]
    seqs = [eng.new_sequence() for _ in hist]
    solo = [alone.new_sequence() for _ in hist]
    for s, t, h in zip(seqs, solo, hist):
        eng.pred(s, h)
        alone.pred(t, h)
    new = [[5], toks(6, seed=10), [7], toks(13, seed=11)]
    out = eng.pred_batch([PredRequest(s, n, all_logits=True) for s, n in zip(seqs, new)])
    for i, n in enumerate(new):
        torch.testing.assert_close(out[i], alone.pred(solo[i], n, all_logits=True), atol=1e-5, rtol=0)
        close(out[i], w, hist[i] + n, torch.bfloat16)
    f = eng.fork(seqs[3])                                    # 43 tokens: a partial page copied
    la, lf = eng.pred(seqs[3], [1]), eng.pred(f, [2])
    close(la[None], w, hist[3] + new[3] + [1], torch.bfloat16)
    close(lf[None], w, hist[3] + new[3] + [2], torch.bfloat16)
    last = 43 // 4
    assert torch.equal(eng.kv.pool[:, :, seqs[3].pages[last], :3].view(torch.int16),
                       eng.kv.pool[:, :, f.pages[last], :3].view(torch.int16))


def test_int8_activations_on_a_bfloat16_pool(tmp_path):
    """``--activations int8`` (prompt attention on the AMX tiles where the CPU has them) reads the
    bfloat16 pool: within the int8 path's own tolerance of the float32 pool's logits, and the
    same greedy tokens."""
    from modelfiles import hf_state_dict, tiny_hf_config, write_gguf
    from symphony.engine.loader import load_model
    cfg = tiny_hf_config(hidden_size=128)                    # head_dim 32: the tiles take it
    w, _ = load_model(write_gguf(tmp_path / "m.gguf", cfg, hf_state_dict(cfg), quant="Q8_0"), progress=False)
    engs = [Engine(w, None, EngineConfig(page_size=16, num_pages=64, kv_dtype=dt))
            for dt in (None, torch.bfloat16)]
    prompt = [(7 * i) % 90 + 3 for i in range(70)]            # 70 tokens x the GQA group: >= 32 rows
    try:
        quant.set_int8_activations(True)
        outs = []
        for e in engs:
            kv = e.new_sequence()
            rows, t = [e.pred(kv, prompt, all_logits=True)], []
            for _ in range(6):
                t.append(int(rows[-1][-1].argmax()))
                rows.append(e.pred(kv, [t[-1]], all_logits=True))
            outs.append((torch.cat(rows), t))
    finally:
        quant.set_int8_activations(False)
    (a, ta), (b, tb) = outs
    scale = a.abs().max()
    assert 0 < (a - b).abs().max() <= 0.02 * scale and ta == tb


def test_kvfs_swaps_and_durable_files_across_kv_dtypes(tmp_path):
    """Swaps keep the pool's bits; a durable file restores in a kernel of the same KV dtype, and
    one with another --kv-dtype (the same model and activations) converts it as it reads it."""
    w = random_weights(tiny_config(), seed=0)

    def fs_(kv_dtype, **kw):
        eng = Engine(w, None, EngineConfig(page_size=4, num_pages=8, kv_dtype=kv_dtype))
        return KVFS(eng, KVFSConfig(**kw))
    d = str(tmp_path / "durable")
    fs = fs_(torch.bfloat16, host_pages=1, swap_dir=str(tmp_path / "swap"), durable_dir=d)
    a = fs.create(ALICE, "/home/alice/a.kv")
    fs.pred(ALICE, a, toks(20, seed=2))                      # 5 of the 7 pages
    ino = fs.handles[a].inode
    before = torch.cat([fs.pager.read(b) for b in ino.blocks], dim=2).clone()
    assert before.dtype == torch.bfloat16
    b = fs.create(ALICE, "/tmp/b.kv")
    fs.pred(ALICE, b, toks(16, seed=3))                      # a's pages to host and disk
    assert any(bl.host >= 0 or bl.disk >= 0 for bl in ino.blocks)
    after = torch.cat([fs.pager.read(bl) for bl in ino.blocks], dim=2)
    assert torch.equal(after.view(torch.int16), before.view(torch.int16))
    close(fs.pred(ALICE, a, [1])[None], w, toks(20, seed=2) + [1], torch.bfloat16)   # swapped back in
    fs.sync(ALICE, a)
    (f,) = os.listdir(d)
    c = w.config
    assert os.path.getsize(os.path.join(d, f)) < 21 * c.n_layers * 2 * c.kv_size * 4  # 2 bytes an element
    again = fs_(torch.bfloat16, durable_dir=d)
    assert again.restore_report["restored"] == ["/home/alice/a.kv"]
    saved = pages_of(again, again.open(ALICE, "/home/alice/a.kv", "r"))
    # a kernel with another --kv-dtype converts the file as it reads it: widened exactly ...
    wide = fs_(None, durable_dir=d)
    assert wide.restore_report["restored"] == ["/home/alice/a.kv"] and not wide.restore_report["refused"]
    h = wide.open(ALICE, "/home/alice/a.kv", "rw")
    assert torch.equal(pages_of(wide, h), saved.float())
    close(wide.pred(ALICE, h, [2])[None], w, toks(20, seed=2) + [1, 2], torch.bfloat16)
    wide.sync(ALICE, h)                                        # ... and a float32 file rounded back
    narrow = fs_(torch.float16, durable_dir=d)
    assert narrow.restore_report["restored"] == ["/home/alice/a.kv"]
    got = pages_of(narrow, narrow.open(ALICE, "/home/alice/a.kv", "r"))
    assert got.dtype == torch.float16 and torch.equal(got, pages_of(wide, h).to(torch.float16))


def pages_of(fs, hid):
    ino = fs.handles[hid].inode
    return torch.cat([fs.pager.read(b) for b in ino.blocks], dim=2)[:, :, :ino.length]


def test_the_flag():
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)

    def cfg(*argv):
        return EngineArgs.from_cli_args(p.parse_args(list(argv))).to_config()
    assert cfg().torch_kv_dtype == torch.float32
    assert cfg("--activations", "int8").torch_kv_dtype == torch.bfloat16     # auto with int8
    assert cfg("--activations", "int8", "--kv-dtype", "float32").torch_kv_dtype == torch.float32
    assert cfg("--kv-dtype", "float16").torch_kv_dtype == torch.float16
    assert cfg("--dtype", "bfloat16", "--activations", "int8").torch_kv_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="needs float32 activations"):
        cfg("--dtype", "bfloat16", "--kv-dtype", "float16")
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-dtype", "int8"])
