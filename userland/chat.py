"""Chat, streamed, keeping the conversation's KV file from turn to turn.

    symphony run userland/chat.py "What is the capital of France?" [--system TEXT]
        [--max-tokens N] [--temperature T] [--top-p P] [--seed S] [-v]
    printf 'And of Italy?\n' | symphony run userland/chat.py "What is the capital of France?"

The first user message comes from the arguments; each line that arrives next
through recv() (symphony run forwards its stdin; -i forwards a terminal) is a
new user turn, answered in the same KV file: the conversation is re-rendered
with the chat template, the KV file is cut back to the tokens it shares with
the new rendering (normally all of it), and only the rest is prefilled.
Greedy by default.  -v reports each turn's prefill and the KV length on stderr.
"""
import argparse
import sys

from symphony.lip import kv, recv, send
from symphony.lip.helpers import chat_prompt, generate
from symphony.lip.sampling import Sampler


def main(*args):
    p = argparse.ArgumentParser(prog="chat.py", description="Chat with the model.")
    p.add_argument("message")
    p.add_argument("--system", default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(args)
    sampler = Sampler(temperature=a.temperature, top_p=a.top_p, seed=a.seed)
    messages = [{"role": "system", "content": a.system}] if a.system else []
    cached = []                                              # the tokens the KV file holds
    with kv.create() as f:
        message = a.message
        while message is not None:
            if message.strip():
                messages.append({"role": "user", "content": message})
                prompt = chat_prompt(messages)
                keep = 0
                while keep < min(len(cached), len(prompt) - 1) and cached[keep] == prompt[keep]:
                    keep += 1
                if keep < len(f):
                    f.truncate(keep)                         # drop what the new rendering changed
                answer, ids = generate(f, prompt[keep:], a.max_tokens, sampler, on_text=send)
                send("\n")
                cached = (prompt + ids)[:len(f)]
                messages.append({"role": "assistant", "content": answer})
                if a.verbose:
                    print(f"[chat: prefilled {len(prompt) - keep} tokens, KV file {len(f)} tokens]",
                          file=sys.stderr)
            message = recv()
