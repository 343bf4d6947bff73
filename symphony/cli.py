"""Command-line entry points: ``symphony`` (here) and ``symphony-kernel`` (symphony/kernel_cli.py).

    symphony-kernel [--model PATH] [--gpus 0] [--socket PATH] ...   the kernel daemon
    symphony run NAME|lip.py [args] [--grant http:HOST] [--grant read:DIR]   (NAME: a stock program)
    symphony run --list  (== symphony programs)                              the stock programs
    symphony ps | kill ID | kv ls [DIR] | kv rm PATH | kv stat PATH
    symphony chat "question" / generate "text"    in-process engine, no kernel needed
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from .engine.args import EngineArgs


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
        EngineArgs.add_cli_args(s)
        s.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    _add_client_cmds(sub)
    args = p.parse_args(argv)
    if args.cmd == "programs" or (args.cmd == "run" and args.list):
        return _list_programs()
    if args.cmd == "run":
        err = _resolve_program(args)
        if err:
            return err
    if args.cmd == "run" and args.remote:
        return _run_remote(args)
    if args.cmd in ("run", "ps", "kill", "kv", "drain"):
        return _client_cmd(args)
    if args.cmd == "keys":
        return _keys_cmd(args)
    from .kernel_cli import LOG_FORMAT
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT,
                        stream=sys.stderr)
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    from .engine.config import ConfigError
    from .engine.loader import ModelLoadError
    eargs = EngineArgs.from_cli_args(args)
    try:
        cfg = eargs.to_config()
    except ConfigError as e:
        raise SystemExit(f"symphony: {e}") from None
    try:
        engine = eargs.load(cfg)
        engine.calibrate_kernels()
        engine.kv.start_commit()
    except ModelLoadError as e:
        print(f"symphony: {e}", file=sys.stderr)
        return 2
    except ValueError as e:                     # $SYMPHONY_QLINEAR_CALIBRATION
        raise SystemExit(f"symphony: {e}") from None
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
    """``symphony-kernel``: the kernel daemon (its flags and startup: symphony/kernel_cli.py)."""
    from .kernel_cli import kernel_main as run_kernel
    return run_kernel(argv)


def _list_programs() -> int:
    """``symphony run --list`` / ``symphony programs``: the stock programs and what they do."""
    from .programs import ProgramError, listing
    try:
        print(listing())
    except ProgramError as e:
        print(f"symphony: {e}", file=sys.stderr)
        return 2
    return 0


def _resolve_program(args) -> int:
    """Turn ``symphony run``'s LIP argument (a stock program's name or a path) into a file path
    in ``args.lip_file``, before connecting; 0, or 2 after printing why it names nothing."""
    import os
    from .programs import ProgramError, available, resolve
    try:
        args.lip_file = str(resolve(args.lip_file or ""))
        stem = os.path.basename(args.lip_file)[:-3] if args.lip_file.endswith(".py") else ""
        if not os.path.isfile(args.lip_file) and stem in available():
            print(f"symphony: cannot read {args.lip_file}: no such file (the stock program: "
                  f"symphony run {stem})", file=sys.stderr)
            return 2
    except ProgramError as e:
        print(f"symphony: {e}", file=sys.stderr)
        return 2
    return 0


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
                from .kernel.escape import printable   # a LIP's name and arguments may hold control characters
                r = c.ps()
                print(f"{'LIP':>5} {'USER':<10} {'STATE':<9} {'PID':>7} {'PREDS':>7} {'TOKENS':>8}  PROGRAM")
                for l in r["lips"]:                # another user's LIP comes without its arguments
                    args_ = printable(" ".join(l["args"])) if "args" in l else "[args hidden]"
                    if l["state"] == "queued":     # its place in the queue instead of a pid and counters
                        pid, preds, tokens = f"#{l.get('position')}", "-", f"{l.get('waited_s', 0):.1f}s"
                    else:
                        pid, preds, tokens = l["pid"], l["preds"], l["tokens"]
                    print(f"{l['lip']:>5} {printable(l['user']):<10} {l['state']:<9} {pid:>7} {preds:>7} "
                          f"{tokens:>8}  {printable(l['file'])} {args_}"[:160])
                return 0
            if args.cmd == "kill":
                c.kill(args.lip)
                print(f"killed LIP {args.lip}")
                return 0
            if args.cmd == "drain":
                c.drain()
                print("draining: the kernel starts no new LIPs; those running finish")
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
                if args.kv_cmd == "export":
                    blob = c.kv_export(args.path)
                    with open(args.file, "xb") as f:          # never over an existing file
                        f.write(blob)
                    print(f"exported {args.path}: {len(blob)} bytes to {args.file}")
                    return 0
                if args.kv_cmd == "import":
                    with open(args.file, "rb") as f:
                        r = c.kv_import(args.path, f.read())
                    print(f"imported {r['path']}: {r['length']} tokens, {r['pages']} pages")
                    return 0
    except KernelError as e:
        print(f"symphony: {e} ({e.code})", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:                   # a local file; a request the client refuses
        print(f"symphony: {e}", file=sys.stderr)
        return 1
    return 2


def _grants(specs):
    """--grant http:HOST[:PORT] / read:DIR options as {"http": [...], "read": [...]} (read
    directories made absolute: a key's grants are read by a gateway with another working
    directory), or None after saying which one is bad."""
    import os
    grants = {"http": [], "read": []}
    for g in specs:
        kind, _, val = g.partition(":")
        if kind not in grants or not val:
            print(f"symphony: bad --grant {g!r} (http:HOST[:PORT] or read:DIR)", file=sys.stderr)
            return None
        grants[kind].append(os.path.abspath(val) if kind == "read" else val)
    return grants


def _run_request(args):
    """(source, grants, limits) of ``symphony run``'s arguments, or an exit status after saying why."""
    import os
    path = args.lip_file
    try:
        source = open(path, encoding="utf-8").read()
    except OSError as e:
        print(f"symphony: cannot read {path}: {e}", file=sys.stderr)
        return 2
    grants = _grants(args.grant)
    if grants is None:
        return 2
    limits = {}
    if args.timeout:
        limits["timeout"] = args.timeout
    if args.cpu:
        limits["cpu_seconds"] = args.cpu
    if args.memory_mb:
        limits["memory_bytes"] = args.memory_mb << 20
    return source, grants, limits


def _run(c, args) -> int:
    import os
    req = _run_request(args)
    if isinstance(req, int):
        return req
    source, grants, limits = req
    reply = c.launch(source, args.lip_args, filename=os.path.basename(args.lip_file), grants=grants, limits=limits,
                     priority=args.priority, kv_tokens=args.kv_tokens)
    return _follow(args, reply, c.events(), c.send_input, c.kill)


def _run_remote(args) -> int:
    """``symphony run --remote URL``: the same run through the HTTP gateway."""
    import os
    from .remote import RemoteClient, RemoteError
    req = _run_request(args)
    if isinstance(req, int):
        return req
    source, grants, limits = req
    try:
        rc = RemoteClient(args.remote)
        run = rc.launch(source, args.lip_args, filename=os.path.basename(args.lip_file), grants=grants,
                        limits=limits, priority=args.priority, kv_tokens=args.kv_tokens)
    except (ValueError, ConnectionError) as e:
        print(f"symphony: {e}", file=sys.stderr)
        return 2
    except RemoteError as e:
        print(f"symphony: {e} (HTTP {e.status}{', ' + e.code if e.code else ''})", file=sys.stderr)
        return 1
    try:
        return _follow(args, run.first, run.events(), rc.send_input, rc.kill)
    finally:
        run.close()


def _follow(args, reply: dict, events, send_input, kill) -> int:
    """Print a running LIP's events as ``symphony run`` does, forward stdin to
    it, and return its exit status (local and remote runs alike)."""
    import json
    import threading
    if reply.get("event") == "exit":                   # lost before it started
        print(f"symphony: {reply.get('reason')}", file=sys.stderr)
        return reply.get("status", 1)
    lip = reply["lip"]
    if reply.get("event") == "queued":                 # always said: the wait is not a hang
        why = reply.get("waiting_for") or "waiting for its turn"
        print(f"symphony: LIP {lip} queued (position {reply.get('position')}; {why})", file=sys.stderr)
    elif args.verbose:
        print(f"symphony: LIP {lip} started", file=sys.stderr)

    def pump_stdin():
        try:
            if sys.stdin is None or sys.stdin.closed or (sys.stdin.isatty() and not args.interactive):
                send_input(lip, None)
                return
            for line in sys.stdin:
                send_input(lip, line.rstrip("\n"))
            send_input(lip, None)
        except Exception:                              # noqa: BLE001 - the LIP may be gone; its exit says why
            pass
    threading.Thread(target=pump_stdin, daemon=True).start()
    status = 1
    try:
        for ev in events:
            kind = ev.get("event")
            if kind == "started":
                if args.verbose:
                    print(f"symphony: LIP {lip} started after waiting {ev.get('waited_s')} s", file=sys.stderr)
            elif kind == "out":
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
        try:
            kill(lip)
        except Exception:                              # noqa: BLE001 - leaving anyway
            pass
        return 130
    return status


def _keys_cmd(args) -> int:
    """``symphony keys add|ls|rm``: the gateway's API keys (keys.py)."""
    from .gateway.keys import KeyFileError, add_key, default_key_file, list_keys, remove_key
    path = args.file or default_key_file()
    try:
        if args.keys_cmd == "add":
            grants = _grants(args.grant)
            if grants is None:
                return 2
            key, entry = add_key(path, args.name, args.user, max_priority=args.max_priority, grants=grants,
                                 rpm=args.rpm, max_concurrent=args.max_concurrent, share_cache=args.share_cache)
            print(key)
            print(f"symphony: key {entry.name!r} for user {entry.user!r} added to {path}; it is shown only "
                  f"this once (send SIGHUP to a running gateway to load it)", file=sys.stderr)
        elif args.keys_cmd == "ls":
            for k in list_keys(path):
                print(f"{k.name:<20} user={k.user:<12} max_priority={k.max_priority:<11} rpm={k.rpm:<7} "
                      f"concurrent={k.max_concurrent:<5} share_cache={str(k.share_cache).lower()} "
                      f"grants={json_compact(k.grants)} created={k.created}")
        elif args.keys_cmd == "rm":
            remove_key(path, args.name)
            print(f"symphony: key {args.name!r} removed from {path}", file=sys.stderr)
    except (KeyFileError, OSError) as e:
        print(f"symphony: {e}", file=sys.stderr)
        return 1
    return 0


def json_compact(v) -> str:
    import json
    return json.dumps(v, separators=(",", ":"))


def _add_client_cmds(sub) -> None:
    def common(s):
        s.add_argument("--socket", default=None, help="kernel socket (default $SYMPHONY_SOCKET or the default path)")
        s.add_argument("--as-user", default=None, help="act as this user (root only)")
    r = sub.add_parser("run", help="run a LIP on the kernel and stream its output",
                       description="Run a LIP: a stock program by name (symphony run chat \"...\"; "
                                   "symphony run --list shows them) or a file (a path with a / or "
                                   "ending in .py, e.g. ./chat or my_lip.py).")
    r.add_argument("lip_file", nargs="?", metavar="PROGRAM",
                   help="a stock program's name (chat, rag, ...) or a LIP file's path")
    r.add_argument("--list", action="store_true", help="list the stock programs and exit")
    r.add_argument("lip_args", nargs=argparse.REMAINDER)
    r.add_argument("--grant", action="append", default=[], help="http:HOST[:PORT] or read:DIR (repeatable)")
    r.add_argument("--timeout", type=float, default=None,
                   help="wall-clock limit, seconds (a wait in the admission queue counts)")
    r.add_argument("--kv-tokens", type=int, default=None,
                   help="KV tokens the LIP is expected to need: it starts when that much KV memory is free")
    r.add_argument("--cpu", type=int, default=None, help="CPU-time limit, seconds")
    r.add_argument("--memory-mb", type=int, default=None, help="address-space limit, MiB")
    r.add_argument("-i", "--interactive", action="store_true", help="forward terminal input to recv()")
    r.add_argument("--priority", default="normal", choices=["batch", "normal", "interactive"],
                   help="scheduling class (default normal)")
    r.add_argument("-v", "--verbose", action="store_true")
    r.add_argument("--remote", default=None, metavar="URL",
                   help="run it through the HTTP gateway at URL (API key from $SYMPHONY_API_KEY)")
    common(r)
    sub.add_parser("programs", help="list the stock programs (symphony run NAME runs one)")
    keys = sub.add_parser("keys", help="the HTTP gateway's API keys")
    ks = keys.add_subparsers(dest="keys_cmd", required=True)
    a = ks.add_parser("add", help="make a key (printed once) for a KVFS user")
    a.add_argument("name")
    a.add_argument("--user", required=True, help="the KVFS user its requests run as (not root)")
    a.add_argument("--max-priority", default="normal", choices=["batch", "normal", "interactive"],
                   help="highest scheduling class its LIPs may ask for (default normal)")
    a.add_argument("--grant", action="append", default=[], metavar="http:HOST[:PORT]|read:DIR",
                   help="a capability its LIPs may ask for (repeatable; default none)")
    a.add_argument("--rpm", type=int, default=600, help="requests per minute (default 600)")
    a.add_argument("--max-concurrent", type=int, default=16, help="requests running at once (default 16)")
    a.add_argument("--share-cache", action="store_true",
                   help="share prefix-cache files with the other keys that do (gateway --prefix-cache shared)")
    ks.add_parser("ls", help="list the keys (never the keys themselves)")
    rm = ks.add_parser("rm", help="remove a key")
    rm.add_argument("name")
    for x in (a, ks.choices["ls"], rm):
        x.add_argument("--file", default=None, help="the key file (default $SYMPHONY_KEYS, "
                       "/etc/symphony/keys.json for root, ~/.config/symphony/keys.json otherwise)")
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
    x = kvs.add_parser("export", help="write a KV file's bytes to a local file (for kv import on any kernel "
                                      "of the same model)")
    x.add_argument("path")
    x.add_argument("file", help="a new local file")
    common(x)
    x = kvs.add_parser("import", help="make a KV file from exported bytes (yours, under your quota)")
    x.add_argument("file")
    x.add_argument("path")
    common(x)
    d = sub.add_parser("drain", help="stop the kernel taking new LIPs while those running finish (root); a "
                                     "gateway then moves its users' KV files to other kernels")
    common(d)


if __name__ == "__main__":
    sys.exit(main())
