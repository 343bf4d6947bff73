"""The embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end."""
import torch

from conftest import SMOLLM_ATOL
from symphony.kernel.engine import PredRequest


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
        want = smollm_reference.forward(full)[-n:]
        assert (got - want).abs().max() <= SMOLLM_ATOL
    # then a batched decode step of all three
    nxt = [int(o[-1].argmax()) for o in out]
    step = smollm.pred_batch([PredRequest(s, [t]) for s, t in zip(seqs, nxt)])
    for got, full, t in zip(step, (a, b, c), nxt):
        assert (got - smollm_reference.forward(full + [t])[-1]).abs().max() <= SMOLLM_ATOL
    for s in seqs:
        smollm.release(s)


def test_batch_equals_members_alone(smollm):
    tok = smollm.tokenizer
    prompts = [tok.encode(t) for t in ("Once upon a time", "import numpy as np\n", "Bonjour, je m'appelle")]
    alone = []
    for p in prompts:
        kv = smollm.new_sequence()
        alone.append(smollm.pred(kv, p))
        smollm.release(kv)
    seqs = [smollm.new_sequence() for _ in prompts]
    together = smollm.pred_batch([PredRequest(s, p) for s, p in zip(seqs, prompts)])
    for x, y in zip(alone, together):
        assert (x - y).abs().max() <= 1e-4
        assert int(x.argmax()) == int(y.argmax())
    for s in seqs:
        smollm.release(s)
    assert smollm.kv.allocator.num_used == 0
