"""userland/constrained.py (llguidance masks applied in the kernel) and
userland/watermark.py (green-list watermark and detector), end to end on the
real kernel and SmolLM2."""
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema

from conftest import REPO

CONSTRAINED = REPO / "userland/constrained.py"
WATERMARK = REPO / "userland/watermark.py"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}


def run_lip(kernel, path, *args, timeout=180):
    """Spawn a LIP through the client (no CLI start-up); (status, outputs, stderr)."""
    with kernel.client() as c:
        c.spawn(path.read_text(), [str(a) for a in args], filename=path.name)
        evs = list(c.events(timeout=timeout))
    assert evs and evs[-1]["event"] == "exit", evs[-3:]
    outs = [e["data"] for e in evs if e["event"] == "out"]
    err = "".join(e["data"] for e in evs if e["event"] == "stderr")
    return evs[-1]["status"], outs, err


def run_many(kernel, jobs, timeout=180):
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda a: run_lip(kernel, *a, timeout=timeout), jobs))


# ---------------------------------------------------------------- constrained decoding
def test_json_schema_every_seed_validates(kernel):
    """Seeds 0..31 at temperature 1.0: four LIPs of 8 samples each, at once (each
    sample has its own matcher, KV fork and seed; the kernel batches them: 32 rows)."""
    t0 = time.time()
    results = run_many(kernel, [(CONSTRAINED, "--json-schema", json.dumps(SCHEMA), "Describe a person as JSON.",
                                 "--temperature", "1.0", "--seed", s, "--n", "8", "--max-tokens", "128")
                                for s in (0, 8, 16, 24)])
    elapsed = time.time() - t0
    samples = []
    for status, outs, err in results:
        assert status == 0, err
        samples += outs
    assert sorted(s["seed"] for s in samples) == list(range(32))
    objs = []
    for s in samples:
        assert s["complete"], s
        obj = json.loads(s["text"])                       # parses ...
        jsonschema.validate(obj, SCHEMA)                  # ... and validates
        objs.append(obj)
    assert len({s["text"] for s in samples}) >= 16        # the seeds really sample
    assert len({o["color"] for o in objs}) >= 2
    print(f"\n32 schema-constrained samples in {elapsed:.1f} s")


def test_json_schema_single_run_streams(kernel):
    """The plain command line: greedy, streamed, exit 0, valid JSON."""
    r = kernel.run(CONSTRAINED, "--json-schema", json.dumps(SCHEMA), "Describe a cat as JSON.",
                   "--max-tokens", "128")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), SCHEMA)


def test_regex_20_seeds_fullmatch(kernel):
    date = r"\d{4}-\d{2}-\d{2}"
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    results = run_many(kernel, [
        (CONSTRAINED, "--regex", date, "When did Apollo 11 land on the moon?", "--temperature", "1.0",
         "--seed", "0", "--n", "20", "--max-tokens", "32"),
        (CONSTRAINED, "--regex", phone, "Give me a phone number.", "--temperature", "1.0",
         "--seed", "0", "--n", "20", "--max-tokens", "32")])
    for (status, outs, err), rx in zip(results, (date, phone)):
        assert status == 0, err
        assert sorted(o["seed"] for o in outs) == list(range(20))
        for o in outs:
            assert o["complete"] and re.fullmatch(rx, o["text"]), o


def test_bad_grammar_and_truncation(kernel):
    status, outs, err = run_lip(kernel, CONSTRAINED, "--regex", "(unclosed", "x")
    assert status == 2 and "bad regex" in err, err
    status, outs, err = run_lip(kernel, CONSTRAINED, "--json-schema", "{not json", "x")
    assert status == 2 and "bad json-schema" in err, err
    status, outs, err = run_lip(kernel, CONSTRAINED, "--regex", "x")
    assert status == 2 and "usage" in err
    # too few tokens for the grammar: what was generated is sent, exit status 3
    status, outs, err = run_lip(kernel, CONSTRAINED, "--regex", r"[a-z]{40}", "Say something.",
                                "--max-tokens", "3")
    assert status == 3 and "ran out" in err, err
    assert re.fullmatch(r"[a-z]+\n", "".join(outs))


# ---------------------------------------------------------------- watermark
PROMPTS = ["Write a short story about a dragon who learns to bake bread.",
           "Describe a busy market in a desert city.",
           "Tell me about the history of the bicycle.",
           "Write a letter to a friend about your summer holiday.",
           "Explain how a volcano erupts.",
           "Describe your perfect weekend.",
           "Write a story about a robot who wants to be a gardener.",
           "What would you do on the first day of living on Mars?"]


def test_watermark_separates_and_needs_the_key(kernel):
    t0 = time.time()
    # delta 3: at 60 tokens delta 2 gave z 3.5..6.7, delta 3 gives 7.4..9.7 (gamma 0.25)
    gen = [(WATERMARK, "generate", p, "--max-tokens", "60", "--seed", i, "--key", "k1", "--delta", d)
           for d in ("3.0", "0") for i, p in enumerate(PROMPTS)]
    results = run_many(kernel, gen)
    t_gen = time.time() - t0
    texts = []
    for status, outs, err in results:
        assert status == 0, err
        texts.append("".join(outs).removesuffix("\n"))
    marked, plain = texts[:len(PROMPTS)], texts[len(PROMPTS):]
    assert marked != plain

    status, outs, err = run_lip(kernel, WATERMARK, "detect", *texts, "--key", "k1")
    assert status == 0, err
    z_marked = [o["z"] for o in outs[:len(PROMPTS)]]
    z_plain = [o["z"] for o in outs[len(PROMPTS):]]
    status, outs_other, err = run_lip(kernel, WATERMARK, "detect", *marked, "--key", "another key")
    assert status == 0, err
    z_other = [o["z"] for o in outs_other]
    print(f"\nwatermark generation of 16 x 60 tokens: {t_gen:.1f} s\n"
          f"z watermarked: {z_marked}\nz plain:       {z_plain}\nz other key:   {z_other}")
    # a sampled answer may end early (EOS), and which one does depends on how the kernel batched
    # the 16 runs (a batch's rows round differently from a lone row's): the z statistics need
    # 20 scored tokens, so they are checked on the answers that have them, nearly all. With a green
    # share p of about 0.75 (gamma 0.25), z ~ (p - gamma) sqrt(T) / sqrt(gamma (1 - gamma)) ~ 1.15
    # sqrt(T): about 5 at 20 tokens, 7 at 40; so z > 5 is asked of the answers of 40 or more
    long_marked = [o for o in outs[:len(PROMPTS)] if o["total"] >= 20]
    assert sum(o["total"] >= 20 for o in outs) >= len(outs) - 2, [o["total"] for o in outs]
    # each answer's z depends on its text's entropy (a low-entropy answer has few tokens the
    # bias can move), so one answer of 58 tokens may score ~4 when the kernel's float rounding
    # sends a sampled answer elsewhere: the typical (median) answer of 40+ tokens is asked z > 6
    zs = sorted(o["z"] for o in long_marked if o["total"] >= 40)
    assert zs and zs[len(zs) // 2] > 6, [(o["z"], o["total"]) for o in outs[:len(PROMPTS)]]
    assert all(o["watermarked"] for o in long_marked)                 # z > 4, the default threshold
    # unwatermarked text (plain sampling; or watermarked under another key) is N(0, 1)
    # under the null: none flagged, and their mean is near 0 (sd of the mean of 16: 0.25)
    assert not any(o["watermarked"] for o in outs[len(PROMPTS):] + outs_other), z_plain + z_other
    assert abs(sum(z_plain + z_other) / 16) < 1, z_plain + z_other


def test_watermark_arguments(kernel):
    status, outs, err = run_lip(kernel, WATERMARK, "detect", "", "--gamma", "0.5")
    assert status == 0 and outs == [{"z": 0.0, "green": 0, "total": 0, "watermarked": False}]
    status, outs, err = run_lip(kernel, WATERMARK, "generate", "x", "--gamma", "1.5")
    assert status == 2 and "usage" in err
    status, outs, err = run_lip(kernel, WATERMARK, "frobnicate")
    assert status == 2 and "usage" in err
