"""Command-line entry points: ``symphony`` and ``symphony-kernel``.

Implemented now (in-process engine):
    symphony chat "question"        chat completion with the model's template, streamed
    symphony generate "text"        plain text continuation, streamed
    symphony-kernel [--model PATH]  loads the model, builds the engine, self-checks

The kernel daemon, ``symphony run lip.py``, ``ps``, ``kill`` and ``kv`` arrive
with the microkernel (see README, "Status").
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face safetensors directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--gpus", default=None, help="GPU index to run on, e.g. 0 (default: CPU)")
    p.add_argument("--kv-memory-mb", type=int, default=256, help="KV page pool size in MiB (default 256)")
    p.add_argument("--page-size", type=int, default=16, help="positions per KV page (default 16)")
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")


def _build_engine(args):
    from .kernel.config import EngineConfig
    from .kernel.engine import Engine
    device = "cpu"
    if args.gpus:
        ids = [g.strip() for g in args.gpus.split(",") if g.strip()]
        if len(ids) != 1 or not ids[0].isdigit():
            raise SystemExit(f"--gpus: one GPU index is supported for now, got {args.gpus!r}")
        device = f"cuda:{ids[0]}"
    cfg = EngineConfig(device=device, page_size=args.page_size,
                       kv_memory_bytes=args.kv_memory_mb * 2**20)
    return Engine.load(args.model, cfg)


def _sample(logits, temperature: float, gen):
    import torch
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def _complete(engine, ids: list[int], max_tokens: int, temperature: float, seed: int) -> None:
    import torch
    from .kernel.tokenizer import StreamDecoder
    tok = engine.tokenizer
    gen = torch.Generator().manual_seed(seed)
    kv = engine.new_sequence()
    stream = StreamDecoder(tok)
    t0 = time.perf_counter()
    logits = engine.pred(kv, ids)
    ttft = time.perf_counter() - t0
    n = 0
    try:
        for n in range(1, max_tokens + 1):
            t = _sample(logits, temperature, gen)
            if t in tok.eos_ids:
                break
            sys.stdout.write(stream.push(t))
            sys.stdout.flush()
            if n == max_tokens or kv.length >= engine.max_seq_len:
                break
            logits = engine.pred(kv, [t])
        sys.stdout.write(stream.flush() + "\n")
    finally:
        engine.release(kv)
    dt = time.perf_counter() - t0
    logging.getLogger("symphony").info("prompt %d tokens, first token %.0f ms, %d tokens in %.2f s",
                                       len(ids), ttft * 1e3, n, dt)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="symphony", description="Symphony LLM serving system")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, helptext in (("chat", "answer a message with the model's chat template"),
                           ("generate", "continue a text")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("text")
        s.add_argument("--max-tokens", type=int, default=128)
        s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--system", default=None, help="system message (chat)")
        _engine_args(s)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT,
                        stream=sys.stderr)
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    from .kernel.loader import ModelLoadError
    try:
        engine = _build_engine(args)
    except ModelLoadError as e:
        print(f"symphony: {e}", file=sys.stderr)
        return 2
    tok = engine.tokenizer
    if args.cmd == "chat":
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + \
               [{"role": "user", "content": args.text}]
        ids = tok.encode_chat(msgs)
    else:
        ids = tok.encode(args.text)
        if not ids:
            p.error("text encodes to no tokens")
    _complete(engine, ids, args.max_tokens, args.temperature, args.seed)
    return 0


def kernel_main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="symphony-kernel",
        description="Load the model and build the engine. (Serving LIPs over a socket arrives "
                    "with the microkernel; today this command loads, self-checks and exits.)")
    _engine_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT,
                        stream=sys.stderr)
    log = logging.getLogger("symphony.kernel")
    from .kernel.loader import ModelLoadError
    try:
        engine = _build_engine(args)
    except ModelLoadError as e:
        log.error("%s", e)
        return 2
    kv = engine.new_sequence()
    ids = engine.tokenizer.encode("The")
    t0 = time.perf_counter()
    engine.pred(kv, ids)
    engine.release(kv)
    log.info("self-check: one forward pass in %.0f ms", (time.perf_counter() - t0) * 1e3)
    log.error("serving LIPs (socket, shared-memory system calls) is not implemented yet; exiting")
    return 3


if __name__ == "__main__":
    sys.exit(main())
