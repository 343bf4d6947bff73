"""Structured output: generation constrained by a JSON schema, a regular
expression or a Lark grammar, with llguidance computing the allowed tokens.

    symphony run userland/constrained.py --json-schema '{"type": "object", ...}' "Describe a cat."
    symphony run userland/constrained.py --regex '\\d{4}-\\d{2}-\\d{2}' "When did Apollo 11 land?"
    symphony run userland/constrained.py --lark 'start: "yes" | "no"' "Is water wet?"
        [--max-tokens N] [--temperature T] [--top-p P] [--seed S] [--n N]

Every step the llguidance matcher writes the bitmask of tokens that keep the
output inside the grammar (ceil(vocab/32) uint32 words, bit i = token i);
`pred(..., mask=bitmask)` applies it in the kernel, before argmax or sampling,
so the model can only pick an allowed token.  The chosen token advances the
matcher.  Bytes the grammar forces (`{"name":"`, ...) are not sampled: the
matcher's fast-forward tokens are appended to the next pred call.  The output
is streamed; it ends when the grammar is complete (the matcher stops or the
model picks EOS where the grammar allows it).

With --n N the program draws N samples at once (seeds S, S+1, ...; one
thread, one matcher and one copy-on-write fork of the prompt's KV file each;
their pred calls share the kernel's batches) and sends one JSON line per
sample: {"sample": i, "seed": s, "text": ..., "tokens": n, "complete": bool}.

Exit status: 0 = complete output; 3 = --max-tokens ran out before the grammar
was complete (what was generated is still sent); 2 = bad arguments or grammar.
JSON schemas produce compact JSON (no optional whitespace) unless the schema
says otherwise in "x-guidance" (e.g. {"whitespace_flexible": true}).
"""
import sys
from concurrent.futures import ThreadPoolExecutor

import llguidance
import numpy as np

from symphony.lip import StreamDecoder, kv, pred, send, tokenizer
from symphony.lip.grammar import ll_tokenizer

USAGE = ("usage: constrained.py (--json-schema SCHEMA | --regex REGEX | --lark GRAMMAR) PROMPT "
         "[--max-tokens N] [--temperature T] [--top-p P] [--seed S] [--n N]")

_STEP_SEED = 0x9E3779B97F4A7C15        # mixes (seed, step) into one seed per pred call


def parse_args(args):
    opts = {"max_tokens": 256, "temperature": 0.0, "top_p": 1.0, "seed": None, "n": 1}
    conv = {"--max-tokens": ("max_tokens", int), "--temperature": ("temperature", float),
            "--top-p": ("top_p", float), "--seed": ("seed", int), "--n": ("n", int)}
    kind = grammar = prompt = None
    it = iter(args)
    for a in it:
        if a in ("--json-schema", "--regex", "--lark"):
            if kind is not None:
                raise ValueError("give one of --json-schema, --regex, --lark")
            kind, grammar = a[2:], next(it, None)
            if grammar is None:
                raise ValueError(f"{a} needs a value")
        elif a in conv:
            key, fn = conv[a]
            v = next(it, None)
            if v is None:
                raise ValueError(f"{a} needs a value")
            opts[key] = fn(v)
        elif a.startswith("--"):
            raise ValueError(f"unknown option {a}")
        elif prompt is None:
            prompt = a
        else:
            raise ValueError(f"unexpected argument {a!r}")
    if kind is None or prompt is None:
        raise ValueError("a grammar option and a prompt are required")
    if opts["n"] < 1:
        raise ValueError("--n must be >= 1")
    if opts["max_tokens"] < 1 or opts["temperature"] < 0 or not 0 < opts["top_p"] <= 1:
        raise ValueError("--max-tokens must be >= 1, --temperature >= 0, --top-p in (0, 1]")
    return kind, grammar, prompt, opts


def grammar_for(kind, text):
    if kind == "json-schema":
        # compact JSON by default: a small model given free whitespace wanders off
        return llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    return llguidance.LLMatcher.grammar_from_lark(text)


def generate(tok, matcher, base, tokens, *, max_tokens, temperature=0.0, top_p=1.0, seed=None,
             emit=None):
    """Decode under `matcher` into a fork of KV file `base` (or a new file when
    `base` is None), starting by feeding `tokens`.  Returns (output token ids,
    complete?).  `emit(token)` is called for each output token (sampled or
    forced by the grammar) as soon as it is decided."""
    out = []
    t = list(tokens)
    words = (tok.vocab_size + 31) // 32
    with (base.fork() if base is not None else kv.create()) as f:
        step = 0
        while len(out) < max_tokens:
            ff = matcher.compute_ff_tokens()[: max_tokens - len(out)]   # forced by the grammar
            if ff:
                if not matcher.consume_tokens(ff):
                    raise RuntimeError(f"llguidance: {matcher.get_error()}")
                t += ff
                out += ff
                for x in ff:
                    emit and emit(x)
            if matcher.is_stopped() or len(out) >= max_tokens:
                break
            # the allowed tokens as little-endian uint32 words, bit i = token i (llguidance's
            # trie has one more word than ceil(vocab/32); its extra bits are never set)
            mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)[:words]
            if matcher.is_error():
                raise RuntimeError(f"llguidance: {matcher.get_error()}")
            if temperature > 0:
                # one seed per call, derived from (seed, step): the same seed at every
                # step would draw the same uniform number every time
                s = None if seed is None else (seed * _STEP_SEED + step) & 0xFFFFFFFFFFFF
                x = pred(f, t, output="sample", temperature=temperature, top_p=top_p, seed=s,
                         mask=mask)
            else:
                x = pred(f, t, output="argmax", mask=mask)
            step += 1
            if x in tok.eos_ids:                            # allowed only where the grammar may end
                matcher.consume_token(x)
                break
            if not matcher.consume_token(x):
                raise RuntimeError(f"llguidance refused token {x}: {matcher.get_error()}")
            out.append(x)
            emit and emit(x)
            t = [x]
    complete = not matcher.is_error() and (matcher.is_accepting() or matcher.is_stopped())
    return out, complete


def main(*args):
    try:
        kind, text, prompt, o = parse_args(args)
    except ValueError as e:
        print(f"constrained: {e}\n{USAGE}", file=sys.stderr)
        return 2
    tok = tokenizer()
    try:
        matcher = llguidance.LLMatcher(ll_tokenizer(), grammar_for(kind, text), log_level=0)
    except ValueError as e:                                 # e.g. a schema that is not JSON
        print(f"constrained: bad {kind}: {e}", file=sys.stderr)
        return 2
    if matcher.is_error():
        print(f"constrained: bad {kind}: {matcher.get_error()}", file=sys.stderr)
        return 2
    prompt_tokens = tok.encode_chat([{"role": "user", "content": prompt}])
    kw = dict(max_tokens=o["max_tokens"], temperature=o["temperature"], top_p=o["top_p"])

    if o["n"] == 1:                                         # stream the one output
        stream = StreamDecoder(tok)

        def emit(x):
            piece = stream.push(x)
            if piece:
                send(piece)
        _, complete = generate(tok, matcher, None, prompt_tokens, seed=o["seed"], emit=emit, **kw)
        send(stream.flush() + "\n")
        incomplete = 0 if complete else 1
    else:                                                   # n samples, one thread each
        with kv.create() as base:                           # the prompt's KV, computed once
            if len(prompt_tokens) > 1:
                pred(base, prompt_tokens[:-1], output="argmax")

            matchers = [matcher.deep_copy() for _ in range(o["n"])]

            def one(i):
                seed = None if o["seed"] is None else o["seed"] + i
                out, complete = generate(tok, matchers[i], base, prompt_tokens[-1:],
                                         seed=seed, **kw)
                send({"sample": i, "seed": seed, "text": tok.decode(out, skip_special=True),
                      "tokens": len(out), "complete": complete})
                return complete
            with ThreadPoolExecutor(min(o["n"], 8)) as pool:
                incomplete = sum(not c for c in pool.map(one, range(o["n"])))
    if incomplete:
        print(f"constrained: --max-tokens {o['max_tokens']} ran out before the output was complete"
              + (f" ({incomplete} of {o['n']} samples)" if o["n"] > 1 else ""), file=sys.stderr)
        return 3
    return 0
