"""Constrained decoding: the constrained LIP vs llama.cpp's JSON-schema mode, same schemas and prompts.

    python perf/paper/constrained.py [--rounds 3] [--max-tokens 96] [--threads 2] [--plot PNG]

Contenders, greedy, the embedded SmolLM2-135M-Instruct Q4_1 GGUF for both:
  symphony   ``symphony run userland/constrained.py --json-schema SCHEMA PROMPT`` through a
             kernel started here (llguidance computes each step's token mask in the LIP; the
             kernel applies it before the argmax);
  llama.cpp  llama-cpp-python (a perf-only dependency) in this process,
             ``create_chat_completion(..., response_format={"type": "json_object", "schema": S})``
             (llama.cpp turns the schema into a GBNF grammar and samples under it), with
             --threads threads.
Both render the prompt with the model's chat template as one user message.

Per (contender, schema): the output, whether it is valid JSON that validates against the
schema (`jsonschema`), output tokens (the kernel's count of the LIP's generated tokens:
the streamed output re-tokenized; llama.cpp's ``usage.completion_tokens``) and wall time
from the request to the last byte.  The contenders alternate within each round (the
order flips every round).  Reported: validity rate, output tokens/s (median over rounds
of total tokens / total time per contender) with the per-round spread, the ratio
symphony / llama.cpp per round, and seconds per request (an output that runs to
--max-tokens without closing its JSON is long and invalid: tokens/s flatters it).  Client-side wall time includes each side's fixed costs
(the LIP's spawn and llguidance's grammar compile; llama.cpp's grammar build), as a user
sees them.  The plot shows tokens/s and seconds per request per schema (invalid outputs hatched).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "perf"))
sys.path.insert(0, str(REPO / "tests"))

from bench_kernel import KernelProc  # noqa: E402
from bench_overload import load_tokenizer  # noqa: E402
from common import cpu_name, pyplot, save  # noqa: E402

CASES = [
    ("person", "Invent a person and describe them.",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                       "city": {"type": "string"}},
      "required": ["name", "age", "city"], "additionalProperties": False}),
    ("product", "Describe a product for sale in a hardware shop.",
     {"type": "object", "properties": {"product": {"type": "string"}, "price": {"type": "number"},
                                       "in_stock": {"type": "boolean"}},
      "required": ["product", "price", "in_stock"], "additionalProperties": False}),
    ("event", "Plan a small team event.",
     {"type": "object", "properties": {"title": {"type": "string"},
                                       "day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]},
                                       "attendees": {"type": "array", "items": {"type": "string"},
                                                     "minItems": 1, "maxItems": 4}},
      "required": ["title", "day", "attendees"], "additionalProperties": False}),
    ("address", "Write the postal address of a museum.",
     {"type": "object", "properties": {"street": {"type": "string"}, "number": {"type": "integer"},
                                       "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                                       "country": {"type": "string"}},
      "required": ["street", "number", "postcode", "country"], "additionalProperties": False}),
]



def valid(text: str, schema: dict) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_symphony(k: KernelProc, tok, prompt: str, schema: dict, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    r = k.run(str(REPO / "userland" / "constrained.py"), "--json-schema", json.dumps(schema), prompt,
              "--max-tokens", str(max_tokens), timeout=600)
    dt = time.perf_counter() - t0
    text = r.stdout.strip()
    if r.returncode not in (0, 3):
        raise RuntimeError(f"constrained.py failed ({r.returncode}): {r.stderr[-400:]}")
    return {"text": text, "tokens": len(tok.encode(text)), "s": dt}


def run_llama(llm, prompt: str, schema: dict, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    out = llm.create_chat_completion(messages=[{"role": "user", "content": prompt}], temperature=0.0,
                                     max_tokens=max_tokens,
                                     response_format={"type": "json_object", "schema": schema})
    dt = time.perf_counter() - t0
    return {"text": out["choices"][0]["message"]["content"].strip(),
            "tokens": out["usage"]["completion_tokens"], "s": dt}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    ap.add_argument("--plot", default=str(Path(__file__).with_name("constrained.png")))
    a = ap.parse_args()
    if a.rounds < 1 or a.max_tokens < 8:
        ap.error("--rounds >= 1, --max-tokens >= 8")
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed (a perf-only dependency: pip install llama-cpp-python)")
        return 2
    from symphony.engine.loader import default_model_path
    gguf = default_model_path()
    tok = load_tokenizer(gguf)
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=1024, n_threads=a.threads, verbose=False)
    tmp = Path(tempfile.mkdtemp(prefix="paper-constrained-"))
    k = KernelProc(tmp)
    print(f"# constrained decoding: SmolLM2-135M-Instruct Q4_1, {cpu_name()}, {os.cpu_count()} vCPUs, "
          f"llama-cpp-python {llama_cpp.__version__} ({a.threads} threads), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    res: dict = {c: {name: [] for name, _, _ in CASES} for c in ("symphony", "llama.cpp")}
    try:
        for name, prompt, schema in CASES:                      # warm-up: each grammar once each
            run_symphony(k, tok, prompt, schema, 8)
            run_llama(llm, prompt, schema, 8)
        for r in range(a.rounds):
            for name, prompt, schema in CASES:
                order = ["symphony", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "symphony"]
                for c in order:
                    x = (run_symphony(k, tok, prompt, schema, a.max_tokens) if c == "symphony"
                         else run_llama(llm, prompt, schema, a.max_tokens))
                    x["valid"] = valid(x["text"], schema)
                    res[c][name].append(x)
                print(f"  round {r + 1}/{a.rounds} {name}: " + "; ".join(
                    f"{c} {res[c][name][-1]['tokens']} tok in {res[c][name][-1]['s']:.2f} s, "
                    f"valid {res[c][name][-1]['valid']}" for c in order), flush=True)
    finally:
        k.proc.terminate()
        k.proc.wait(30)

    def rate(c, r):
        xs = [res[c][n][r] for n, _, _ in CASES]
        return sum(x["tokens"] for x in xs) / sum(x["s"] for x in xs)
    print("\n| contender | valid | output tok/s (median, spread) | per schema tok/s | s per request (median) |")
    print("|---|---|---|---|---|")
    for c in res:
        v = sum(x["valid"] for n in res[c] for x in res[c][n])
        total = sum(len(res[c][n]) for n in res[c])
        rates = [rate(c, r) for r in range(a.rounds)]
        per = ", ".join(f"{n} {statistics.median(x['tokens'] / x['s'] for x in res[c][n]):.1f}" for n in res[c])
        secs = statistics.median(x["s"] for n in res[c] for x in res[c][n])
        print(f"| {c} | {v}/{total} | {statistics.median(rates):.1f} ({min(rates):.1f}..{max(rates):.1f}) | {per} "
              f"| {secs:.2f} |")
    ratios = [rate("symphony", r) / rate("llama.cpp", r) for r in range(a.rounds)]
    print(f"\nsymphony / llama.cpp tokens/s: {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}..{max(ratios):.2f})")
    print("\nsample outputs (last round):")
    for n, _, _ in CASES:
        for c in res:
            print(f"  {n:8s} {c:9s} {res[c][n][-1]['text'][:110]}")
    plt = pyplot()
    if plt is None:
        return 0
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = [n for n, _, _ in CASES]
    for i, c in enumerate(res):
        xs = [j + 0.38 * i for j in range(len(names))]
        ax.bar(xs, [statistics.median(x["tokens"] / x["s"] for x in res[c][n]) for n in names], 0.38, label=c)
        bars = ax2.bar(xs, [statistics.median(x["s"] for x in res[c][n]) for n in names], 0.38, label=c)
        for bar, n in zip(bars, names):                  # hatched: most of its outputs were invalid
            if sum(x["valid"] for x in res[c][n]) * 2 < len(res[c][n]):
                bar.set_hatch("//")
    for a_ in (ax, ax2):
        a_.set_xticks([j + 0.19 for j in range(len(names))], names)
    ax.set_ylabel("output tokens/s (median, client wall)")
    ax2.set_ylabel("seconds per request (median); hatched: invalid JSON")
    ax.legend()
    fig.suptitle(f"JSON-schema constrained decoding, SmolLM2-135M Q4_1, {cpu_name()[:40]}", fontsize=9)
    save(fig, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
