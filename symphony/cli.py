"""Command-line entry points: ``symphony`` and ``symphony-kernel``.

    symphony-kernel [--model PATH] [--gpus 0] [--socket PATH] ...   the kernel daemon
    symphony run lip.py [args] [--grant http:HOST] [--grant read:DIR]
    symphony ps | kill ID | kv ls [DIR] | kv rm PATH | kv stat PATH
    symphony chat "question" / generate "text"    in-process engine, no kernel needed
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
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights, activations and KV pool (default float32 on a CPU, bfloat16 on a GPU)")
    p.add_argument("--weights", default="auto", choices=["auto", "quantized", "float"],
                   help="quantized GGUF tensors: keep them quantized in memory and compute on their "
                        "bits, or dequantize them to --dtype at load (default auto: quantized on a CPU, "
                        "float on a GPU)")
    p.add_argument("--quantize", default=None, choices=["int8", "int4"],
                   help="quantize float weights (safetensors, F16/F32 GGUF) at load, groups of 32")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run decode steps eagerly instead of replaying captured CUDA graphs (GPU only)")
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")


def _build_engine(args):
    from .engine.config import DTYPES, ConfigError, EngineConfig
    from .engine.engine import Engine
    device = "cpu"
    if args.gpus:
        ids = [g.strip() for g in args.gpus.split(",") if g.strip()]
        if len(ids) != 1 or not ids[0].isdigit():
            raise SystemExit(f"--gpus: one GPU index is supported for now, got {args.gpus!r}")
        device = f"cuda:{ids[0]}"
    try:
        cfg = EngineConfig(device=device, dtype=DTYPES[args.dtype] if args.dtype else None,
                           page_size=args.page_size, kv_memory_bytes=args.kv_memory_mb * 2**20,
                           cuda_graphs=False if args.no_cuda_graphs else None,
                           weights=args.weights, quantize=args.quantize)
    except ConfigError as e:
        raise SystemExit(f"symphony: {e}") from None
    return Engine.load(args.model, cfg)


def _sample(logits, temperature: float, gen):
    """One token from ``logits`` [vocab]: greedy at temperature <= 0, else drawn from ``gen``."""
    from .engine.sampler import SamplingParams, sample
    return int(sample(logits.unsqueeze(0), SamplingParams(max(temperature, 0.0)), generator=gen)[0])


def _complete(engine, ids: list[int], max_tokens: int, temperature: float, seed: int) -> None:
    import torch
    from .tokenizer import StreamDecoder
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
    _add_client_cmds(sub)
    args = p.parse_args(argv)
    if args.cmd in ("run", "ps", "kill", "kv"):
        return _client_cmd(args)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT,
                        stream=sys.stderr)
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    from .engine.loader import ModelLoadError
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


def _nonneg_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return n


def _pages_or_percent(text: str):
    """'N' pages (an int) or 'N%' of the pool (a float in (0, 1])."""
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            pct = -1.0
        if not 0 < pct <= 100:
            raise argparse.ArgumentTypeError(f"expected a percentage in (0, 100], got {text!r}")
        return pct / 100
    return _nonneg_int(text)


def _umask(text: str) -> int:
    try:
        m = int(text, 8)
    except ValueError:
        m = -1
    if not 0 <= m <= 0o777:
        raise argparse.ArgumentTypeError(f"expected an octal umask 000..777, got {text!r}")
    return m


def kernel_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="symphony-kernel", description="The Symphony kernel daemon.")
    _engine_args(p)
    p.add_argument("--socket", default=None, help="Unix socket path (default $SYMPHONY_SOCKET, "
                   "$XDG_RUNTIME_DIR/symphony.sock or /tmp/symphony-UID.sock)")
    p.add_argument("--host-pages", type=int, default=256, help="host-memory KV tier, pages (default 256)")
    p.add_argument("--swap-dir", default=None, help="directory for the disk KV tier (default: none)")
    p.add_argument("--durable-dir", default=None, help="directory for durable KV files (default: none)")
    p.add_argument("--user-quota", type=_pages_or_percent, default="50%",
                   help="KV pages one user may hold, all tiers: N pages or N%% of the device + host "
                        "pages (default 50%%); root is exempt")
    p.add_argument("--user-inodes", type=_nonneg_int, default=10000,
                   help="named KV files + directories one user may own (default 10000); root is exempt")
    p.add_argument("--kv-umask", type=_umask, default=0o022,
                   help="octal bits cleared from every KV file/directory mode a LIP asks for (default 022: "
                        "no file is writable by other users; 077: nothing can be shared)")
    p.add_argument("--process-quota", type=int, default=None, help="KV pages one LIP may hold")
    p.add_argument("--max-lips", type=int, default=256)
    p.add_argument("--token-budget", type=int, default=None,
                   help="tokens per forward pass (default 256 on a CPU, 2048 on a GPU); long prompts "
                        "are fed in chunks of half of it")
    p.add_argument("--lip-uids", default=None, metavar="FIRST-LAST",
                   help="uids (= gids) LIPs run as, one per live LIP, when the kernel runs as root "
                        "(default 61184-65519)")
    _limit_args(p)
    _cap_args(p)
    p.add_argument("--test-hooks", action="store_true",
                   help="enable root-only fault-injection requests (tests only; never in production)")
    args = p.parse_args(argv)
    caps = _cap_policy(p, args)                  # validated before the model loads
    try:
        policy = _policy(args)
    except ValueError as e:
        p.error(str(e))
    from .kernel.identity import DEFAULT_RANGE, parse_range
    try:
        lip_uids = parse_range(args.lip_uids) if args.lip_uids is not None else DEFAULT_RANGE
    except ValueError as e:
        p.error(f"--lip-uids: {e}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT,
                        stream=sys.stderr)
    log = logging.getLogger("symphony.kernel")
    from .engine.loader import ModelLoadError
    try:
        engine = _build_engine(args)
    except ModelLoadError as e:
        log.error("%s", e)
        return 2
    try:
        _warm_up(engine)
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    from .kernel.daemon import Kernel
    from .ipc.protocol import default_socket_path
    from .kvfs import KVFS, KVFSConfig
    user_pages = args.user_quota
    if isinstance(user_pages, float):               # a share of the device + host tiers
        user_pages = int(user_pages * (engine.kv.allocator.capacity + args.host_pages))
    log.info("KV quotas: %d pages per user, %s per LIP, %d named files per user; umask %03o", user_pages,
             args.process_quota if args.process_quota is not None else "no limit", args.user_inodes,
             args.kv_umask)
    fs = KVFS(engine, KVFSConfig(host_pages=args.host_pages, swap_dir=args.swap_dir,
                                 durable_dir=args.durable_dir, user_page_quota=user_pages,
                                 process_page_quota=args.process_quota, user_inode_quota=args.user_inodes,
                                 umask=args.kv_umask))
    kernel = Kernel(engine, fs, args.socket or default_socket_path(), max_lips=args.max_lips,
                    token_budget=args.token_budget, policy=policy,
                    max_queued_output=args.max_queued_output_kb << 10, cap_policy=caps, lip_uids=lip_uids,
                    test_hooks=args.test_hooks)
    try:
        import uvloop
        uvloop.run(kernel.serve())
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    return 0


def _cap_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("capabilities (what a LIP's --grant may give it)")
    g.add_argument("--allow-read", action="append", default=None, metavar="DIR",
                   help="a root under which read grants may be given (repeatable; 'none': no read "
                        "grants; default: anywhere -- files are still read with the user's own permissions)")
    g.add_argument("--deny-read", action="append", default=[], metavar="DIR",
                   help="a path no capability may open (repeatable; always denied: /proc, /sys, /dev, "
                        "/run and the kernel's own directories)")
    g.add_argument("--allow-http", action="append", default=None, metavar="HOST[:PORT]",
                   help="a host http grants may name: HOST, HOST:PORT or *.DOMAIN (repeatable; 'none': "
                        "no http grants; default: any host)")
    g.add_argument("--cap-workers", type=int, default=4, help="capability worker threads (default 4)")
    g.add_argument("--cap-share", type=int, default=2,
                   help="capability calls one LIP may have running at once; more wait their turn (default 2)")
    g.add_argument("--cap-timeout", type=float, default=30.0,
                   help="longest a capability call may take, seconds (default 30; http's own timeout "
                        "may be shorter)")


def _cap_policy(p: argparse.ArgumentParser, args):
    """The capability policy from the kernel's flags (exits with a usage error if one is bad)."""
    import os
    from .kernel.capabilities import CapPolicy
    from .ipc.protocol import default_socket_path
    build = os.environ.get("SYMPHONY_BUILD_DIR") or os.path.expanduser("~/.cache/symphony")
    try:
        return CapPolicy.build(allow_read=args.allow_read, deny_read=args.deny_read, allow_http=args.allow_http,
                               kernel_dirs=[args.durable_dir, args.swap_dir, build],
                               socket_path=args.socket or default_socket_path(), workers=args.cap_workers,
                               per_lip=args.cap_share, timeout_s=args.cap_timeout)
    except (ValueError, RuntimeError) as e:
        p.error(str(e))


def _limit_args(p: argparse.ArgumentParser) -> None:
    """The administrator's ceilings and defaults for every LIP (kernel/limits.py)."""
    g = p.add_argument_group("LIP limits (a client may ask for less than a ceiling, never more)")
    g.add_argument("--lip-memory-mb", type=int, default=4096, help="address-space ceiling of a LIP (default 4096)")
    g.add_argument("--lip-cpu", type=float, default=600, help="CPU-time ceiling, seconds (default 600; 0: none)")
    g.add_argument("--lip-timeout", type=float, default=3600,
                   help="wall-clock ceiling, seconds (default 3600; 0: none)")
    g.add_argument("--lip-threads", type=int, default=64, help="threads/processes ceiling of a LIP (default 64)")
    for name, what in (("memory-mb", "address space, MiB"), ("cpu", "CPU time, s"), ("timeout", "wall clock, s"),
                       ("threads", "threads")):
        g.add_argument(f"--default-lip-{name}", type=float if name in ("cpu", "timeout") else int, default=None,
                       help=f"{what} a LIP gets when its client asks for none (default: the ceiling)")
    g.add_argument("--max-priority", default="normal", choices=["batch", "normal", "interactive"],
                   help="highest scheduling class any user may ask for (default normal)")
    g.add_argument("--user-priority", action="append", default=[], metavar="USER=CLASS",
                   help="let USER ask for up to CLASS (repeatable), e.g. alice=interactive")
    g.add_argument("--max-lips-per-user", type=int, default=None,
                   help="LIPs one user may run at once (default: a quarter of --max-lips)")
    g.add_argument("--max-queued-output-kb", type=int, default=1024,
                   help="output of one LIP held for its client before its send() waits (default 1024)")


def _policy(args):
    """The LimitPolicy the kernel flags describe (ValueError names a bad flag)."""
    from .kernel.limits import LimitPolicy
    users = {}
    for u in args.user_priority:
        name, sep, cls = u.partition("=")
        if not sep or not name:
            raise ValueError(f"--user-priority {u!r}: expected USER=CLASS")
        users[name] = cls
    ceilings = {"memory_bytes": args.lip_memory_mb << 20, "cpu_seconds": args.lip_cpu or None,
                "timeout": args.lip_timeout or None, "threads": args.lip_threads}
    defaults = {k: v for k, v in (("memory_bytes", args.default_lip_memory_mb and args.default_lip_memory_mb << 20),
                                  ("cpu_seconds", args.default_lip_cpu), ("timeout", args.default_lip_timeout),
                                  ("threads", args.default_lip_threads)) if v}
    for k, v in ceilings.items():                  # no default given: the ceiling
        defaults.setdefault(k, v)
    if args.max_queued_output_kb < 64:
        raise ValueError("--max-queued-output-kb must be >= 64")
    per_user = args.max_lips_per_user if args.max_lips_per_user is not None else max(1, args.max_lips // 4)
    return LimitPolicy(ceilings=ceilings, defaults=defaults, max_priority=args.max_priority,
                       user_priority=users, max_lips_per_user=per_user)
def _warm_up(engine) -> None:
    """Before the kernel says "ready": build/load the C++ ops (a stale build
    lock is cleared, a live builder waited for) and run one forward pass, with
    progress on stderr, so that no LIP's first pred pays for (or hangs on) it."""
    from .engine import ops
    t0 = time.perf_counter()
    print("symphony-kernel: loading the C++ ops...", file=sys.stderr, flush=True)
    ops.load()
    t1 = time.perf_counter()
    print(f"symphony-kernel: C++ ops loaded in {t1 - t0:.1f} s; warming up one forward pass...",
          file=sys.stderr, flush=True)
    seq = engine.new_sequence()
    try:
        engine.pred(seq, [0])
    finally:
        engine.release(seq)
    print(f"symphony-kernel: warm-up forward pass took {time.perf_counter() - t1:.1f} s",
          file=sys.stderr, flush=True)


def _client_cmd(args) -> int:
    from .client import Client, KernelError
    try:
        c = Client(args.socket, user=getattr(args, "as_user", None))
    except ConnectionError as e:
        print(f"symphony: {e}", file=sys.stderr)
        return 2
    try:
        with c:
            if args.cmd == "run":
                return _run(c, args)
            if args.cmd == "ps":
                r = c.ps()
                print(f"{'LIP':>5} {'USER':<10} {'STATE':<9} {'PID':>7} {'PREDS':>7} {'TOKENS':>8}  PROGRAM")
                for l in r["lips"]:                # another user's LIP comes without its arguments
                    args_ = " ".join(l["args"]) if "args" in l else "[args hidden]"
                    print(f"{l['lip']:>5} {l['user']:<10} {l['state']:<9} {l['pid']:>7} {l['preds']:>7} "
                          f"{l['tokens']:>8}  {l['file']} {args_}"[:160])
                return 0
            if args.cmd == "kill":
                c.kill(args.lip)
                print(f"killed LIP {args.lip}")
                return 0
            if args.cmd == "kv":
                if args.kv_cmd == "ls":
                    for e in c.kv_ls(args.path):
                        extra = f"{e['length']:>7} tok {e['pages']:>5} pages" if e["type"] == "file" else f"{'<dir>':>23}"
                        print(f"{oct(e['mode'])[2:]:>5} {e['owner']:<10} {extra}  {e['name']}")
                    return 0
                if args.kv_cmd == "rm":
                    c.kv_rm(args.path)
                    return 0
                if args.kv_cmd == "stat":
                    import json
                    print(json.dumps(c.kv_stat(args.path), indent=2))
                    return 0
    except KernelError as e:
        print(f"symphony: {e} ({e.code})", file=sys.stderr)
        return 1
    return 2


def _run(c, args) -> int:
    import json
    import os
    import threading
    path = args.lip_file
    try:
        source = open(path, encoding="utf-8").read()
    except OSError as e:
        print(f"symphony: cannot read {path}: {e}", file=sys.stderr)
        return 2
    grants = {"http": [], "read": []}
    for g in args.grant:
        kind, _, val = g.partition(":")
        if kind not in grants or not val:
            print(f"symphony: bad --grant {g!r} (http:HOST[:PORT] or read:DIR)", file=sys.stderr)
            return 2
        grants[kind].append(os.path.abspath(val) if kind == "read" else val)
    limits = {}
    if args.timeout:
        limits["timeout"] = args.timeout
    if args.cpu:
        limits["cpu_seconds"] = args.cpu
    if args.memory_mb:
        limits["memory_bytes"] = args.memory_mb << 20
    lip = c.spawn(source, args.lip_args, filename=os.path.basename(path), grants=grants, limits=limits,
                  priority=args.priority)
    if args.verbose:
        print(f"symphony: LIP {lip} started", file=sys.stderr)

    def pump_stdin():
        try:
            if sys.stdin is None or sys.stdin.closed or (sys.stdin.isatty() and not args.interactive):
                c.send_input(lip, None)
                return
            for line in sys.stdin:
                c.send_input(lip, line.rstrip("\n"))
            c.send_input(lip, None)
        except (OSError, ValueError):
            pass
    threading.Thread(target=pump_stdin, daemon=True).start()
    status = 1
    try:
        for ev in c.events():
            kind = ev.get("event")
            if kind == "out":
                d = ev["data"]
                sys.stdout.write(d if isinstance(d, str) else json.dumps(d) + "\n")
                sys.stdout.flush()
            elif kind == "stdout":
                sys.stdout.write(ev["data"])
                sys.stdout.flush()
            elif kind == "stderr":
                sys.stderr.write(ev["data"])
                sys.stderr.flush()
            elif kind == "exit":
                status = ev["status"]
                if ev.get("reason") not in ("finished",):
                    print(f"symphony: LIP {lip} {ev['reason']} (status {status})", file=sys.stderr)
    except KeyboardInterrupt:
        c.kill(lip)
        return 130
    return status


def _add_client_cmds(sub) -> None:
    def common(s):
        s.add_argument("--socket", default=None, help="kernel socket (default $SYMPHONY_SOCKET or the default path)")
        s.add_argument("--as-user", default=None, help="act as this user (root only)")
    r = sub.add_parser("run", help="run a LIP on the kernel and stream its output")
    r.add_argument("lip_file")
    r.add_argument("lip_args", nargs=argparse.REMAINDER)
    r.add_argument("--grant", action="append", default=[], help="http:HOST[:PORT] or read:DIR (repeatable)")
    r.add_argument("--timeout", type=float, default=None, help="wall-clock limit, seconds")
    r.add_argument("--cpu", type=int, default=None, help="CPU-time limit, seconds")
    r.add_argument("--memory-mb", type=int, default=None, help="address-space limit, MiB")
    r.add_argument("-i", "--interactive", action="store_true", help="forward terminal input to recv()")
    r.add_argument("--priority", default="normal", choices=["batch", "normal", "interactive"],
                   help="scheduling class (default normal)")
    r.add_argument("-v", "--verbose", action="store_true")
    common(r)
    ps = sub.add_parser("ps", help="list running LIPs")
    common(ps)
    k = sub.add_parser("kill", help="kill a LIP")
    k.add_argument("lip", type=int)
    common(k)
    kv = sub.add_parser("kv", help="inspect KV files")
    kvs = kv.add_subparsers(dest="kv_cmd", required=True)
    for name, helptext in (("ls", "list a KVFS directory"), ("rm", "remove a KV file"), ("stat", "show a KV file")):
        x = kvs.add_parser(name, help=helptext)
        x.add_argument("path", nargs="?" if name == "ls" else None, default="/")
        common(x)


if __name__ == "__main__":
    sys.exit(main())
