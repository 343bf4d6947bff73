"""The engine's sampler (symphony/engine/sampler.py): the CPU nucleus search against a full sort."""
from __future__ import annotations

import torch

from symphony.engine import sampler
from symphony.engine.sampler import check_sampling, nucleus, sample


def full_sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: sort the whole row, keep the smallest prefix reaching top_p, [rows, vocab]."""
    sp, si = probs.sort(dim=-1, descending=True)
    sp = sp.masked_fill(sp.cumsum(-1) - sp >= top_p, 0)
    return torch.zeros_like(probs).scatter(-1, si, sp)


def scatter(sp: torch.Tensor, si: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.zeros(sp.shape[0], vocab).scatter(-1, si, sp)


def test_nucleus_is_the_full_sorts_set_in_both_paths():
    g = torch.Generator().manual_seed(0)
    vocab = 49152
    peaked = torch.randn(4, vocab, generator=g) * 4          # the nucleus is among the top 1024
    flat = torch.randn(3, vocab, generator=g) * 0.01         # it is not: the whole rows are sorted
    for logits in (peaked, flat, torch.cat([peaked[:2], flat[:1]])):
        probs = torch.softmax(logits, -1)
        for top_p in (0.1, 0.5, 0.9, 0.999):
            sp, si = nucleus(probs, top_p)
            got, want = scatter(sp, si, vocab), full_sort_nucleus(probs, top_p)
            assert torch.equal(got > 0, want > 0), (top_p, (got > 0).sum(-1), (want > 0).sum(-1))
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (nucleus(torch.softmax(flat, -1), 0.9)[0] > 0).sum(-1).min() > sampler.NUCLEUS_CANDIDATES


def test_top_p_draws_only_from_the_nucleus_with_its_odds():
    # 5 tokens with probabilities .5 .2 .15 .1 .05: top_p .8 keeps the first three
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    p = check_sampling(1.0, top_p=0.8, seed=3)
    g = torch.Generator().manual_seed(3)
    draws = torch.stack([sample(logits, p, generator=g) for _ in range(6000)]).flatten()
    counts = torch.bincount(draws, minlength=5).float() / len(draws)
    assert counts[3] == 0 and counts[4] == 0
    torch.testing.assert_close(counts[:3], torch.tensor([0.5, 0.2, 0.15]) / 0.85, atol=0.02, rtol=0)


def test_a_seed_gives_the_same_tokens():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    p = check_sampling(0.8, top_p=0.95, seed=11)
    assert torch.equal(sample(logits, p), sample(logits, p))


def test_min_p_drops_what_the_lips_sampler_drops_and_keeps_the_odds_of_the_rest():
    # probabilities .5 .2 .15 .1 .05: min_p .25 keeps tokens of at least .125 (the first three)
    from symphony.lip.sampling import Sampler
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    for top_p, kept in ((1.0, 3), (0.6, 2)):            # with top_p: the nucleus first, then min_p
        p = check_sampling(1.0, top_p=top_p, seed=3, min_p=0.25)
        g = torch.Generator().manual_seed(3)
        draws = torch.stack([sample(logits, p, generator=g) for _ in range(6000)]).flatten()
        counts = torch.bincount(draws, minlength=5).float() / len(draws)
        want = torch.from_numpy(Sampler(temperature=1.0, top_p=top_p, min_p=0.25).probs(logits[0].numpy())).float()
        assert int((want > 0).sum()) == kept and torch.equal(counts > 0, want > 0)
        torch.testing.assert_close(counts, want, atol=0.02, rtol=0)
    # min_p 1 keeps the most likely token only: the greedy token, whatever the seed
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(2))
    for seed in range(5):
        assert torch.equal(sample(logits, check_sampling(1.5, seed=seed, min_p=1.0)), logits.argmax(-1))


def test_min_p_out_of_range_is_refused_by_name():
    import pytest
    from symphony.engine.sampler import SamplingError
    for bad in (-0.1, 1.5, float("nan"), "0.1", True):
        with pytest.raises(SamplingError, match="min_p must be a number in"):
            check_sampling(1.0, min_p=bad)
    assert check_sampling(1.0, min_p=None).min_p == 0.0
