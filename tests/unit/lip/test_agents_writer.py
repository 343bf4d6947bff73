"""The agents' Writer: a forced choice asks the model only where the options differ, and every
token written reaches the KV file once, in order."""
import pytest

from symphony.lip import agents
from modelfiles import tiny_tokenizer


class FakeFile:
    """What pred sees: the tokens fed, in order, and each call's mask."""

    def __init__(self):
        self.fed, self.masks = [], []


@pytest.fixture
def writer(monkeypatch):
    tok = tiny_tokenizer()
    f = FakeFile()

    def pred(file, tokens, output="argmax", mask=None):
        file.fed += list(tokens)
        file.masks.append(mask)
        return max(mask) if mask else 2            # the largest allowed id; EOS without a mask
    monkeypatch.setattr(agents, "pred", pred)
    return agents.Writer(f, tok, "hello "), f, tok


def test_choose_asks_only_where_the_options_differ(writer):
    w, f, tok = writer
    options = ["transfer to ab", "transfer to cd", "answer:"]
    seqs = [tok.encode(o) for o in options]
    pick = w.choose(options)
    assert pick in options
    path = tok.encode(pick)
    # the points on the chosen path where the options still alive differ: one pass each
    branching = sum(len({s[i] for s in seqs if s[:i] == path[:i]}) > 1 for i in range(len(path)))
    assert 1 <= branching < len(path)
    assert len(f.masks) == branching and w.generated == branching
    assert all(len(m) > 1 for m in f.masks)
    w.flush()
    assert f.fed == tok.encode("hello ") + tok.encode(pick)      # every token once, in order
    assert w.fed == len(f.fed)


def test_a_single_option_and_a_forced_path_cost_no_pass(writer):
    w, f, tok = writer
    assert w.choose(["only"]) == "only"
    assert w.choose(["same start x", "same start x"]) == "same start x"   # nothing to decide
    assert f.masks == [] and w.generated == 0
    w.flush()
    assert f.fed == tok.encode("hello ") + tok.encode("only") + tok.encode("same start x")


def test_choose_needs_an_option(writer):
    with pytest.raises(ValueError):
        writer[0].choose([])
