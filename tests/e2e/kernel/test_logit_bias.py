"""pred's logit_bias through a real kernel on SmolLM2: every output against the plain
logits plus the bias (computed in the LIP), the bias before the mask, and each bad
bias refused at submission with the file untouched."""
import json

from conftest import REPO


def test_logit_bias_applies_in_the_kernel_and_bad_ones_are_refused(kernel):
    r = kernel.run(REPO / "tests/e2e/lips/biased.py")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["logits_max_diff"] < 1e-4                            # bias added exactly, in float32
    assert out["argmax"][0] == out["argmax"][1] == 7                # +100 on token 7 wins
    assert out["masked_argmax"][0] == out["masked_argmax"][1]       # a biased token outside the mask stays out
    ids, order, diff = out["topk"]
    assert ids == order and diff < 1e-3
    assert out["sample"] == 11
    assert out["length_after"][0] + 1 == out["length_after"][2]
    assert out["refused"] == {k: "EINVAL" for k in ("id_out_of_vocab", "negative_id", "too_big", "nan", "inf",
                                                    "repeated", "too_many", "not_pairs", "string_ids")}
