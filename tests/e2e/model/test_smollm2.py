"""The embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end."""
import pytest
import torch

from conftest import SMOLLM_ATOL
from symphony.engine.engine import PredRequest


_REF = {}


def ref_logits(ref, tokens):
    """``ref.forward(tokens)``, memoized: the float32 reference is deterministic, and the
    float32 and both half-precision tests compare against it on the same prompts."""
    key = (id(ref), tuple(tokens))
    if key not in _REF:
        _REF[key] = ref.forward(list(tokens))
    return _REF[key]


def greedy(engine, ids, max_tokens=40):
    kv, out = engine.new_sequence(), []
    logits = engine.pred(kv, ids)
    for _ in range(max_tokens):
        t = int(logits.argmax())
        if t in engine.tokenizer.eos_ids:
            break
        out.append(t)
        logits = engine.pred(kv, [t])
    engine.release(kv)
    return engine.tokenizer.decode(out)


def test_config_and_tokenizer(smollm):
    c, tok = smollm.model_config, smollm.tokenizer
    assert (c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_embeddings and c.rope_theta == 100000.0
    text = "Symphony serves programs, not prompts: 12 ms, naïve café ☕"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("123") == [tok.token_to_id(d) for d in "123"]      # digits split one by one
    assert tok.eos_ids[0] == tok.token_to_id("<|im_end|>")


def test_greedy_chat_answers_paris(smollm):
    ids = smollm.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    answer = greedy(smollm, ids)
    assert "Paris" in answer, answer


def test_paged_logits_match_reference_on_the_real_model(smollm, smollm_reference):
    tok = smollm.tokenizer
    a = tok.encode_chat([{"role": "user", "content": "Name three colours of the rainbow."}])
    b = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    c = tok.encode("The quick brown fox")
    seqs = [smollm.new_sequence() for _ in range(3)]
    smollm.pred(seqs[0], a[:-3])
    smollm.pred(seqs[1], b[:10])
    out = smollm.pred_batch([PredRequest(seqs[0], a[-3:], all_logits=True),   # short chunk
                             PredRequest(seqs[1], b[10:], all_logits=True),   # long chunk
                             PredRequest(seqs[2], c, all_logits=True)])       # fresh prefill
    for got, full, n in ((out[0], a, 3), (out[1], b, len(b) - 10), (out[2], c, len(c))):
        want = ref_logits(smollm_reference, full)[-n:]
        assert (got - want).abs().max() <= SMOLLM_ATOL
    # then a batched decode step of all three
    nxt = [int(o[-1].argmax()) for o in out]
    step = smollm.pred_batch([PredRequest(s, [t]) for s, t in zip(seqs, nxt)])
    for got, full, t in zip(step, (a, b, c), nxt):
        assert (got - ref_logits(smollm_reference, full + [t])[-1]).abs().max() <= SMOLLM_ATOL
    for s in seqs:
        smollm.release(s)


def assert_batch_equals_members_alone(eng, atol):
    """Three prompts fed one by one and as one batch: the same last logits (within
    ``atol``) and the same greedy token; every page comes back."""
    tok = eng.tokenizer
    prompts = [tok.encode(t) for t in ("Once upon a time", "import numpy as np\n", "Bonjour, je m'appelle")]
    alone = []
    for p in prompts:
        kv = eng.new_sequence()
        alone.append(eng.pred(kv, p))
        eng.release(kv)
    seqs = [eng.new_sequence() for _ in prompts]
    together = eng.pred_batch([PredRequest(s, p) for s, p in zip(seqs, prompts)])
    for x, y in zip(alone, together):
        assert (x - y).abs().max() <= atol
        assert int(x.argmax()) == int(y.argmax())
    for s in seqs:
        eng.release(s)
    assert eng.kv.allocator.num_used == 0


def test_batch_equals_members_alone(smollm):
    assert_batch_equals_members_alone(smollm, 1e-4)


# ---------------------------------------------------------------- bfloat16 / float16 on the CPU
# Max |logit| is ~30-40 on these prompts. Measured on 6 prompts (chat, code, prose; 4-37 tokens),
# every position's logits, against ReferenceLlama in float32 on the same weights:
#                       bfloat16                      float16
#   max |diff|          <= 3.7% of max |logit|         <= 0.9%       (tol 5% / 1.5%)
#   mean |diff|         0.07 - 0.21                   0.011 - 0.047 (tol 0.25 / 0.06)
#   argmax agreement    ~97% of positions             100%          (tol 90% / 98%)
# The plain PyTorch loop run in the same dtype is off from float32 by as much (mean 0.10-0.17
# in bfloat16), so the paged path adds no error of its own: its total mean |diff| must stay
# within 1.3x the loop's. Engine vs that loop, max |diff|: <= 0.85 (bf16), <= 0.15 (fp16).
# A batch vs its members run alone: float16 identical; bfloat16 up to 0.75, because oneDNN's
# bfloat16 matmul rounds a row differently depending on how many rows the call carries.
HALF_SMOLLM = {
    torch.bfloat16: dict(max_rel=0.05, mean=0.25, agree=0.90, same_dtype=1.5, batch=1.5),
    torch.float16: dict(max_rel=0.015, mean=0.06, agree=0.98, same_dtype=0.3, batch=1e-4),
}
PROMPTS = [("chat", "Name three colours of the rainbow."),
           ("text", "def fibonacci(n):\n    if n < 2:\n        return n\n"),
           ("text", "The quick brown fox"), ("text", "Once upon a time"),
           ("text", "import numpy as np\n"), ("text", "Bonjour, je m'appelle")]


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def smollm_half(request, smollm):
    """The same weights in a reduced dtype (not reloaded), and the plain loop in that dtype."""
    from symphony.engine.config import EngineConfig
    from symphony.engine.engine import Engine
    from symphony.engine.reference import ReferenceLlama
    dt = request.param
    w = smollm.model.w.dequantized()     # dense half weights (the CPU default keeps them quantized)
    eng = Engine(w, smollm.tokenizer, EngineConfig(page_size=16, num_pages=128, dtype=dt, weights="float"))
    return eng, ReferenceLlama(w, dtype=dt)


def _encode(tok, kind, text):
    return tok.encode_chat([{"role": "user", "content": text}]) if kind == "chat" else tok.encode(text)


def test_half_logits_within_tolerance_of_float32(smollm_half, smollm_reference):
    eng, ref_dt = smollm_half
    tol = HALF_SMOLLM[eng.dtype]
    assert eng.kv.pool.dtype == eng.dtype and eng.model.w.layers[0].wqkv.dtype == eng.dtype
    tok = eng.tokenizer
    seqs, prompts = [], [_encode(tok, k, t) for k, t in PROMPTS]
    wants = [ref_logits(smollm_reference, p) for p in prompts]
    err = err_loop = agree = n = 0.0
    for p, want in zip(prompts, wants):
        kv = eng.new_sequence()
        got = eng.pred(kv, p, all_logits=True)
        seqs.append(kv)
        loop = ref_dt.forward(p)
        d = (got - want).abs()
        assert d.max() <= tol["max_rel"] * want.abs().max(), (len(p), float(d.max()))
        assert d.mean() <= tol["mean"], (len(p), float(d.mean()))
        assert (got - loop).abs().max() <= tol["same_dtype"]
        err += float(d.sum())
        err_loop += float((loop - want).abs().sum())
        agree += float((got.argmax(-1) == want.argmax(-1)).sum())
        n += len(p)
    assert err <= 1.3 * err_loop, (err, err_loop)
    assert agree / n >= tol["agree"], agree / n
    # a batched decode step of all of them
    nxt = [int(w[-1].argmax()) for w in wants]
    step = eng.pred_batch([PredRequest(s, [t]) for s, t in zip(seqs, nxt)])
    for got, p, t in zip(step, prompts, nxt):
        want = ref_logits(smollm_reference, p + [t])[-1]
        assert (got - want).abs().max() <= tol["max_rel"] * want.abs().max()
    for s in seqs:
        eng.release(s)
    assert eng.kv.allocator.num_used == 0


def test_half_batch_equals_members_alone(smollm_half):
    eng, _ = smollm_half
    assert_batch_equals_members_alone(eng, HALF_SMOLLM[eng.dtype]["batch"])


def test_half_greedy_chat_answers_paris(smollm_half):
    """A question whose first token wins by 1.5 logits in float32: both dtypes answer Paris.

    The existing prompt ("What is the capital of France?") is not used here: in float32 its
    first token is a near-tie, "The" 25.33 vs "L" 25.24, closer than bfloat16's error, and the
    bfloat16 engine (and, by as narrow a margin, ReferenceLlama in bfloat16 with a bfloat16
    head) starts "L'Étoile..." instead. test_half_near_tie_is_within_tolerance checks that."""
    eng, _ = smollm_half
    ids = eng.tokenizer.encode_chat([{"role": "user",
                                      "content": "What is the capital of France? Answer in one sentence."}])
    answer = greedy(eng, ids)
    assert "Paris" in answer, answer
    assert eng.kv.allocator.num_used == 0


def test_half_near_tie_is_within_tolerance(smollm_half, smollm, smollm_reference):
    eng, _ = smollm_half
    tok = eng.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    want = ref_logits(smollm_reference, ids)[-1]
    top2 = want.topk(2)
    the, l_ = tok.encode("The")[0], tok.encode("L")[0]
    assert top2.indices.tolist() == [the, l_]
    margin = float(top2.values[0] - top2.values[1])
    assert margin < 0.1                                 # a near-tie in float32
    kv = eng.new_sequence()
    got = eng.pred(kv, ids)
    eng.release(kv)
    assert (got - want).abs().max() <= HALF_SMOLLM[eng.dtype]["max_rel"] * want.abs().max()
    assert set(got.topk(2).indices.tolist()) == {the, l_}   # the same two candidates
