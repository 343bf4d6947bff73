"""What the model itself says about the Open Responses suite's prompts: the evidence that a
compliance test the gateway fails is the model's answer, not the protocol.

    python perf/openresponses_logprobs.py [--socket PATH]     # a running symphony-kernel

For each prompt of the suite whose outcome depends on the model (the tool-calling test's
`tool_choice: auto`, the tests that wait for the model to stop), a LIP run through the
kernel renders the prompt exactly as the stock serving program does (chat template, the
tools section) and reports, from the model's own logits (log-softmax, nats):

* the five most likely first tokens of the answer;
* the log-probability of the answer starting with the tool-call marker ``<tool_call>``
  (all its tokens, teacher-forced), which is what `tool_choice: auto` needs;
* the greedy answer (at most 64 tokens), whether it ends with an end-of-sequence token, and
  the end-of-sequence log-probability where the greedy answer ends;
* with ``--samples N`` (default 8): N answers sampled at temperature 1 (the Responses API's
  default), each cut at ``--cap`` tokens (default 256): how many stopped on their own, and
  their lengths.

Prints one JSON object per prompt, then a Markdown table.  Nothing here depends on the
gateway: the same prompt through `/v1/responses` gets the same tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WEATHER = [{"name": "get_weather", "description": "Get the current weather for a location",
            "parameters": {"type": "object", "properties": {"location": {
                "type": "string", "description": "The city and state, e.g. San Francisco, CA"}},
                "required": ["location"]}}]
CASES = {
    "tool-calling": ([{"role": "user", "content": "What's the weather like in San Francisco?"}], WEATHER),
    "streaming-response": ([{"role": "user", "content": "Count from 1 to 5."}], None),
    "websocket-response": ([{"role": "user", "content": "Count from 1 to 3."}], None),
    "websocket-sequential-responses": ([{"role": "user", "content": "Reply with exactly: first"}], None),
    "websocket-continuation": ([{"role": "user", "content": "Remember the code word: cobalt. Reply with OK."}], None),
    "system-prompt": ([{"role": "system", "content": "You are a pirate. Always respond in pirate speak."},
                       {"role": "user", "content": "Say hello."}], None),
    "previous-response-id": ([{"role": "user", "content": "Remember this code word: papaya. Reply with only OK."}],
                             None),
    # the other version's tests that wait for the model to stop: its fixture PDF as the gateway reads
    # it, and the second turn of its function-call round trip (no tools given again)
    "file-input": ([{"role": "user", "content": "Read the attached file and answer with its title only."
                     "[file openresponses-fixture.pdf]\nTitle: OpenResponses File Input Fixture\n"}], None),
    "function-call-roundtrip": ([{"role": "user", "content": "Use the weather tool to get the temperature in "
                                  "San Francisco."},
                                 {"role": "assistant", "content": "", "tool_calls": [
                                     {"id": "call_1", "name": "get_weather",
                                      "arguments": "{\"location\": \"San Francisco, CA\"}"}]},
                                 {"role": "tool", "tool_call_id": "call_1", "content": "64 degrees and clear"}],
                                None),
}

LIP = r'''
import json
import numpy as np
from symphony.lip import kv, pred, send, tokenizer
from symphony.lip.sampling import Sampler, log_softmax
from symphony.lip.tools import MARKER, render

def main(cases_json, samples, cap):
    tok = tokenizer()
    eos = set(tok.eos_ids)
    out = {}
    for name, (messages, tools) in json.loads(cases_json).items():
        prompt = tok.encode_chat(render(messages, tools))
        r = {"prompt_tokens": len(prompt)}
        with kv.create() as f:
            pred(f, prompt[:-1], output="argmax")
            with f.fork() as g:
                lp = log_softmax(np.array(pred(g, prompt[-1:])))
            top = np.argsort(-lp)[:5]
            r["first_tokens"] = [[tok.decode([int(t)]), round(float(lp[t]), 3)] for t in top]
            marker = tok.encode(MARKER)
            with f.fork() as g:
                total, feed = 0.0, prompt[-1:]
                for t in marker:
                    total += float(log_softmax(np.array(pred(g, feed)))[t])
                    feed = [t]
            r["marker_logprob"] = round(total, 3)
            with f.fork() as g:
                feed, answer, stop_lp = prompt[-1:], [], None
                for _ in range(64):
                    row = log_softmax(np.array(pred(g, feed)))
                    t = int(np.argmax(row))
                    if t in eos:
                        stop_lp = float(row[t])
                        break
                    answer.append(t)
                    feed = [t]
                r["greedy"] = tok.decode(answer)
                r["greedy_stops"] = stop_lp is not None
                r["eos_logprob_at_greedy_end"] = None if stop_lp is None else round(stop_lp, 3)
            lengths, stopped = [], 0
            for k in range(int(samples)):
                s = Sampler(temperature=1.0, seed=k)
                with f.fork() as g:
                    feed, n = prompt[-1:], 0
                    while n < int(cap):
                        t = s.sample(pred(g, feed))
                        n += 1
                        if t in eos:
                            stopped += 1
                            break
                        feed = [t]
                lengths.append(n)
            r["sampled_t1"] = {"n": int(samples), "cap": int(cap), "stopped": stopped, "lengths": lengths}
        out[name] = r
    send(out)
'''


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=os.environ.get("SYMPHONY_SOCKET"))
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--cap", type=int, default=256)
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    args = ap.parse_args(argv)
    cases = {k: v for k, v in CASES.items() if not args.only or k in args.only.split(",")}
    with tempfile.TemporaryDirectory() as d:
        lip = Path(d) / "openresponses_logprobs_lip.py"
        lip.write_text(LIP)
        env = dict(os.environ, PYTHONPATH=str(REPO))
        if args.socket:
            env["SYMPHONY_SOCKET"] = args.socket
        r = subprocess.run([sys.executable, "-m", "symphony.cli", "run", str(lip), json.dumps(cases),
                            str(args.samples), str(args.cap)], capture_output=True, text=True, env=env, cwd=REPO)
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return r.returncode
    out = json.loads(r.stdout)
    for name, v in out.items():
        print(json.dumps({name: v}))
    print("\n| prompt | first tokens (logprob) | `<tool_call>` logprob | greedy answer | greedy stops (EOS logprob) "
          "| sampled at T=1: stopped / n, lengths |")
    print("|---|---|---|---|---|---|")
    for name, v in out.items():
        first = ", ".join(f"`{t!r}` {p}" for t, p in v["first_tokens"][:3])
        s = v["sampled_t1"]
        print(f"| {name} | {first} | {v['marker_logprob']} | {v['greedy'][:60]!r} | {v['greedy_stops']} "
              f"({v['eos_logprob_at_greedy_end']}) | {s['stopped']}/{s['n']}, {sorted(s['lengths'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
