"""Text completion, streamed: the model continues the prompt (no chat template).

    symphony run userland/complete.py "Once upon a time" [--max-tokens N] [--temperature T]
        [--top-p P] [--top-k K] [--min-p M] [--repetition-penalty R] [--seed S] [--stop STR]...

--temperature 0 is greedy (the kernel picks the argmax); otherwise the logits
come back to the LIP and symphony.lip.sampling.Sampler draws the token
(--seed makes it reproducible).  Output stops at the end-of-sequence token, at
the first --stop string (not printed) or after --max-tokens tokens.
"""
import argparse

from symphony.lip import kv, send, tokenize
from symphony.lip.helpers import generate
from symphony.lip.sampling import Sampler


def parse(args):
    p = argparse.ArgumentParser(prog="complete.py", description="Complete a text prompt.")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    return p, p.parse_args(args)


def main(*args):
    p, a = parse(args)
    try:
        sampler = Sampler(a.temperature, a.top_k, a.top_p, a.min_p, a.repetition_penalty, a.seed)
    except ValueError as e:
        p.error(str(e))                                      # usage + message, exit status 2
    with kv.create() as f:                                   # anonymous KV file, freed on close
        generate(f, tokenize(a.prompt), a.max_tokens, sampler, stop=a.stop, on_text=send)
    send("\n")
