"""The kernel daemon's command line: ``symphony-kernel`` (== ``python -m symphony.kernel``).

Three steps, one function each: `parser` (the flags: engine, KV tiers and quotas, LIP limits,
capabilities), `config_from_args` (a checked `KernelConfig`; a bad flag exits here, before the
model loads) and `build` (load the model, build/load the C++ ops, warm up one forward pass, make
the `Kernel`); `kernel_main` runs them and serves.  The engine flags (``--model``, ``--dtype``,
...) are `EngineArgs`' (symphony/engine/args.py), shared with ``symphony chat|generate``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

from .engine.args import EngineArgs
from .kernel.flagtypes import host_pages as _host_pages, nonneg_int as _nonneg_int, umask as _umask
from .kernel.flagtypes import pages_or_percent as _pages_or_percent, positive_int as _positive_int

if TYPE_CHECKING:
    from .engine.config import EngineConfig
    from .kernel.loop.bounds import ClientBounds
    from .kernel.capabilities import CapPolicy
    from .kernel.loop.limits import LimitPolicy
    from .sched.admission import AdmissionLimits

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def kernel_main(argv=None) -> int:
    """``symphony-kernel``: parse and check the flags, load the model, build/load the ops and
    warm up, then serve until stopped; returns the exit status."""
    p = parser()
    args = p.parse_args(argv)
    cfg = config_from_args(p, args)                      # usage errors exit here, before the model loads
    log = _start_logging(cfg.verbose)
    from .engine.config import ConfigError
    from .engine.loader import ModelLoadError
    from .engine.tp.group import TPFailure
    if cfg.engine.is_other_rank():                       # another machine's ranks, or a launcher's rank > 0
        try:
            return cfg.engine.run_other_ranks()
        except (ModelLoadError, ConfigError) as e:
            log.error("%s", e)
            return 2
    try:
        kernel = build(cfg, log)
    except (ModelLoadError, ConfigError) as e:
        log.error("%s", e)
        return 2
    except (StartupError, TPFailure) as e:
        log.error("%s", e)
        return 1
    try:
        import uvloop
        uvloop.run(kernel.serve())
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    finally:
        kernel.engine.close()                            # the other tensor-parallel ranks stop
        from .engine.tp.launch import exit_if_broken
        exit_if_broken(kernel.engine, log)
    return 0


def parser() -> argparse.ArgumentParser:
    """``symphony-kernel``'s flags."""
    p = argparse.ArgumentParser(prog="symphony-kernel", description="The Symphony kernel daemon.")
    EngineArgs.add_cli_args(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    p.add_argument("--socket", default=None, help="Unix socket path (default $SYMPHONY_SOCKET, "
                   "$XDG_RUNTIME_DIR/symphony.sock or /tmp/symphony-UID.sock)")
    p.add_argument("--host-pages", type=_host_pages, default="auto",
                   help="most pages the host-memory KV tier may grow to (made in chunks as suspended LIPs "
                        "and evicted files need them); 'auto' (default): 4x the device pool, at most a "
                        "quarter of the machine's RAM")
    p.add_argument("--kv-wait", type=float, default=30.0, metavar="SECONDS",
                   help="how long pred calls may all wait for device KV pages that cannot move (some LIP "
                        "blocked holding them, host and disk tiers full) before the least important "
                        "waiting LIP gets NoSpace (default 30)")
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
    p.add_argument("--user-page-refs", type=_nonneg_int, default=None,
                   help="pages one user's KV files may map, a fork counting every page it shares (default "
                        "16x --user-quota); root is exempt")
    p.add_argument("--max-lips", type=int, default=256,
                   help="LIPs running at once (default 256); more wait in the admission queue")
    _admission_args(p)
    from .kernel.loop import bounds as client_bounds
    client_bounds.add_cli_args(p)
    p.add_argument("--token-budget", type=int, default=None,
                   help="tokens per forward pass (default 256 on a CPU, 2048 on a GPU); long prompts "
                        "are fed in chunks of half of it")
    p.add_argument("--lip-uids", default=None, metavar="FIRST-LAST",
                   help="uids (= gids) LIPs run as, one per live LIP, when the kernel runs as root "
                        "(default 61184-65519)")
    _limit_args(p)
    _cap_args(p)
    p.add_argument("--lip-nice", type=int, default=0, choices=range(0, 20), metavar="0..19",
                   help="nice value LIP workers start with (default 0)")
    p.add_argument("--lip-busy-cpu", type=float, default=0.1, metavar="FRACTION",
                   help="share of a core above which a LIP that computes between its calls (more than 2 ms "
                        "a call) is demoted (nice 19, SCHED_IDLE), so that it runs on the CPU the model leaves (default 0.1; "
                        "0: never)")
    p.add_argument("--threads", type=_positive_int, default=None, help="CPU threads the model computes "
                   "with (default: torch's, one per core); only the device thread computes, the others use one")
    p.add_argument("--serial-steps", action="store_true", help="a diagnosis aid: run each forward pass on "
                   "the syscall thread, not on a device thread of its own while the syscall thread serves on")
    p.add_argument("--http", default=None, metavar="HOST:PORT",
                   help="also serve HTTP (the OpenAI API and programs over HTTP) on HOST:PORT: starts "
                        "symphony-gateway as a child, stopped with the kernel")
    p.add_argument("--gateway-uid", type=_positive_int, default=None, metavar="UID",
                   help="the uid of the HTTP gateway, trusted to act for any user but root (default with "
                        "--http: a free uid of --lip-uids on a root kernel, the kernel's own otherwise); "
                        "give it to trust a symphony-gateway you run yourself")
    from .kernel.loop import remote
    remote.add_cli_args(p)
    from .gateway.config import add_args as gateway_args
    gateway_args(p)
    p.add_argument("--test-hooks", action="store_true",
                   help="enable root-only fault-injection requests (tests only; never in production)")
    return p


@dataclass(frozen=True)
class KernelConfig:
    """What ``symphony-kernel``'s flags ask for, checked (`config_from_args`); sizes that depend
    on the model (``--host-pages auto``, a ``--user-quota`` in %) are resolved by `build`."""

    engine: EngineArgs
    engine_config: EngineConfig
    verbose: bool
    socket: str
    threads: Optional[int]              # None: torch's default
    host_pages: Union[int, str]         # "auto": auto_host_pages(engine)
    swap_dir: Optional[str]
    durable_dir: Optional[str]
    user_quota: Union[int, float]       # pages, or a share of the device + host pages
    user_inodes: int
    kv_umask: int
    process_quota: Optional[int]
    user_page_refs: Optional[int]       # None: 16x the user quota
    kv_wait_s: float
    max_lips: int
    token_budget: Optional[int]
    policy: LimitPolicy
    max_queued_output: int              # bytes
    caps: CapPolicy
    admission: AdmissionLimits
    bounds: ClientBounds
    lip_uids: tuple[int, int]           # (first, last) uid LIPs run as (a root kernel)
    lip_nice: int
    lip_busy_cpu: float
    gateway: Optional[dict]             # {"http", "uid", "argv"} with --http or --gateway-uid
    test_hooks: bool
    overlap: bool = True                # the forward pass on a device thread (not --serial-steps)
    listen: Optional[object] = None     # kernel.loop.remote.ListenConfig with --listen
    peer_durable_dirs: tuple = ()       # --peer-durable-dir (real paths)


def config_from_args(p: argparse.ArgumentParser, args) -> KernelConfig:
    """The checked configuration of parsed flags; a bad value exits with a usage error naming
    its flag (a bad engine setting: with its message), before anything is loaded."""
    caps = _cap_policy(p, args)
    admission = _admission(p, args)
    from .kernel.loop import bounds as client_bounds
    bounds = client_bounds.from_args(p, args)
    try:
        policy = _policy(args)
    except ValueError as e:
        p.error(str(e))
    if not 0 <= args.lip_busy_cpu <= 64:
        p.error(f"--lip-busy-cpu must be in [0, 64] (a share of a core), got {args.lip_busy_cpu}")
    gateway = _gateway(p, args)
    if not 0 < args.kv_wait <= 86400:
        p.error(f"--kv-wait must be in (0, 86400] seconds, got {args.kv_wait}")
    from .kernel.identity import DEFAULT_RANGE, parse_range
    try:
        lip_uids = parse_range(args.lip_uids) if args.lip_uids is not None else DEFAULT_RANGE
    except ValueError as e:
        p.error(f"--lip-uids: {e}")
    from .kernel.loop import remote
    listen, peers = remote.from_args(p, args)
    from .engine.config import ConfigError
    from .ipc.protocol import default_socket_path
    engine = EngineArgs.from_cli_args(args)
    try:
        engine_config = engine.to_config()
        engine.check()                                   # --gpus against this machine, --tp against --gpus, ...
    except ConfigError as e:
        raise SystemExit(f"symphony: {e}") from None
    return KernelConfig(
        engine=engine, engine_config=engine_config, verbose=args.verbose,
        socket=args.socket or default_socket_path(), threads=args.threads, host_pages=args.host_pages,
        swap_dir=args.swap_dir, durable_dir=args.durable_dir, user_quota=args.user_quota,
        user_inodes=args.user_inodes, kv_umask=args.kv_umask, process_quota=args.process_quota,
        user_page_refs=args.user_page_refs, kv_wait_s=args.kv_wait, max_lips=args.max_lips,
        token_budget=args.token_budget, policy=policy, max_queued_output=args.max_queued_output_kb << 10,
        caps=caps, admission=admission, bounds=bounds, lip_uids=lip_uids, lip_nice=args.lip_nice,
        lip_busy_cpu=args.lip_busy_cpu, gateway=gateway, test_hooks=args.test_hooks, listen=listen,
        peer_durable_dirs=peers, overlap=not args.serial_steps)


def build(cfg: KernelConfig, log: logging.Logger):
    """Load the model, build/load the ops and warm up, then make the KV file system and the
    `Kernel` (not yet serving).  ModelLoadError; StartupError if the ops or the warm-up fail."""
    import torch
    from .engine.hostmem import retain_freed_memory
    kept = retain_freed_memory()                    # before the model's memory is allocated
    if kept:
        log.info("%s", kept)
    compute_threads = cfg.threads or torch.get_num_threads()
    # One OpenMP team in the process: the device thread's, which runs every step. A team made by
    # this thread as well (loading, the warm-up) would outlive its use, and libgomp, seeing more
    # threads than cores, then lets its workers sleep between parallel regions instead of
    # spinning: every region pays a futex wake-up, and a decode step took 2.6x as long on 2
    # cores (perf/RESULTS.md). Here everything computes on one thread.
    torch.set_num_threads(1)
    from .engine import cuda_kernels
    from .engine.ops import calibrate
    try:                                            # bad settings in the environment, before loading
        cuda_kernels.mode_from_env()
        calibrate.setting()
    except ValueError as e:
        raise StartupError(str(e)) from e
    engine = cfg.engine.load(cfg.engine_config)
    try:
        return _build(cfg, log, engine, compute_threads if engine.tp is None or cfg.threads else engine.tp.threads)
    except BaseException:
        engine.close()                              # the other tensor-parallel ranks stop too
        raise


def _build(cfg: KernelConfig, log: logging.Logger, engine, compute_threads: int):
    # (the quantized kernels are calibrated and logged by the device thread, which runs them)
    _warm_up(engine)
    from .kernel.daemon import Kernel
    from .kernel.syscall.proc import ServedLips
    from .kvfs import KVFS, KVFSConfig
    from .engine.config import dtype_name
    host_pages = auto_host_pages(engine) if cfg.host_pages == "auto" else cfg.host_pages
    log.info("KV tiers: %d device pages (%.0f MiB, %s), host tier up to %d pages, %s", engine.kv.allocator.capacity,
             engine.kv.allocator.capacity * engine.kv.page_bytes / 2**20, dtype_name(engine.kv.dtype),
             host_pages,
             f"disk tier in {cfg.swap_dir}" if cfg.swap_dir else "no disk tier")
    user_pages = cfg.user_quota
    if isinstance(user_pages, float):               # a share of the device + host tiers
        user_pages = int(user_pages * (engine.kv.allocator.capacity + host_pages))
    user_refs = cfg.user_page_refs if cfg.user_page_refs is not None else 16 * user_pages
    log.info("KV quotas: %d pages per user, %s per LIP, %d named files per user, %d pages mapped per user; "
             "umask %03o", user_pages, cfg.process_quota if cfg.process_quota is not None else "no limit",
             cfg.user_inodes, user_refs, cfg.kv_umask)
    served = ServedLips()                           # the syscall thread's LIPs: KVFS swaps blocked ones first
    fs = KVFS(engine, KVFSConfig(host_pages=host_pages, swap_dir=cfg.swap_dir,
                                 durable_dir=cfg.durable_dir, user_page_quota=user_pages,
                                 process_page_quota=cfg.process_quota, user_inode_quota=cfg.user_inodes,
                                 user_ref_quota=user_refs, umask=cfg.kv_umask), evict_first=served.swap_out_first,
              pinned=served.running_ids)     # running LIPs lose pages only whole (kernel/syscall/residency.py)
    return Kernel(engine, fs, cfg.socket, served=served, max_lips=cfg.max_lips,
                  token_budget=cfg.token_budget, policy=cfg.policy,
                  max_queued_output=cfg.max_queued_output, cap_policy=cfg.caps, lip_uids=cfg.lip_uids,
                  test_hooks=cfg.test_hooks, admission=cfg.admission, kv_wait_s=cfg.kv_wait_s,
                  compute_threads=compute_threads, bounds=cfg.bounds, lip_nice=cfg.lip_nice,
                  lip_busy_cpu=cfg.lip_busy_cpu, gateway=cfg.gateway, listen=cfg.listen,
                  peer_durable_dirs=cfg.peer_durable_dirs, overlap=cfg.overlap)


class StartupError(RuntimeError):
    """The C++ ops could not be built or loaded, or the warm-up forward pass failed."""


# ---------------------------------------------------------------- helpers
def _start_logging(verbose: bool) -> logging.Logger:
    """Log to stderr, DEBUG with -v, every line escaped (no control character from a LIP or a
    client reaches the log); the kernel's logger."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    from .kernel.escape import SafeFormatter
    for h in logging.getLogger().handlers:
        h.setFormatter(SafeFormatter(LOG_FORMAT))
    return logging.getLogger("symphony.kernel")


def _gateway(p: argparse.ArgumentParser, args) -> Optional[dict]:
    """The HTTP gateway to start (--http) or trust (--gateway-uid), or None."""
    if args.http is None and args.gateway_uid is None:
        return None
    from .gateway.config import ConfigError, parse_hostport, to_argv
    if args.http is not None:
        try:
            parse_hostport(args.http)
        except ConfigError as e:
            p.error(f"--http: {e}")
    if args.http is not None and os.geteuid() == 0:
        from .ipc.protocol import default_socket_path
        sock = os.path.abspath(args.socket or default_socket_path())
        closed = _closed_dir(os.path.dirname(sock))
        if closed:
            p.error(f"--http: the gateway gives up root and runs as another uid, which cannot reach the "
                    f"socket {sock}: {closed} is not searchable by other users (chmod o+x {closed}, or "
                    "put the socket in a directory every user may search)")
    return {"http": args.http, "uid": args.gateway_uid, "argv": to_argv(args)}


def auto_host_pages(engine) -> int:
    """The host tier's default ceiling: 4x the device pool, at most a quarter
    of the RAM.  Its pages are made only as they are needed (64 at a time), so
    the ceiling costs nothing until LIPs are suspended or files evicted."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 8 << 30
    return max(0, min(4 * engine.kv.allocator.capacity, ram // 4 // engine.kv.page_bytes))


_ADMISSION_FLAGS = (   # flag, default, what it bounds (all ints >= 1)
    ("--max-queued", 1024, "LIPs waiting in the admission queue, all users"),
    ("--max-queued-per-user", 256, "LIPs waiting in the admission queue, one user"),
    ("--max-queued-mb", 256, "MiB of program source and arguments the waiting LIPs may hold, all users"),
    ("--max-queued-mb-per-user", 64, "MiB of program source and arguments one user's waiting LIPs may hold"),
    ("--lip-kv-tokens", 512, "KV tokens a LIP is expected to need when its client gives no hint "
                             "(spawn kv_tokens) and no LIP of its program ran lately"),
    ("--spawn-rate", 20, "LIPs one user may start a second; more wait in the admission queue"))


def _admission_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("admission queue (a LIP that cannot start now waits its turn)")
    for flag, default, what in _ADMISSION_FLAGS:
        g.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")


def _admission(p: argparse.ArgumentParser, args):
    """The admission queue's bounds from the flags (argparse error if one is bad)."""
    from .sched.admission import AdmissionLimits
    try:
        return AdmissionLimits(max_queued=args.max_queued, max_queued_per_user=args.max_queued_per_user,
                               max_queued_bytes=args.max_queued_mb << 20, default_kv_tokens=args.lip_kv_tokens,
                               max_queued_bytes_per_user=args.max_queued_mb_per_user << 20,
                               spawns_per_s=args.spawn_rate)
    except ValueError as e:
        p.error(f"admission queue: {e} (from --max-queued, --max-queued-per-user, --max-queued-mb, "
                f"--max-queued-mb-per-user, --lip-kv-tokens, --spawn-rate)")


def _closed_dir(d: str):
    """The first directory from / down to ``d`` that other users may not search, or None."""
    path = "/"
    for part in [x for x in d.split("/") if x]:
        path = os.path.join(path, part)
        try:
            if not os.stat(path).st_mode & 0o001:
                return path
        except OSError:
            return None                     # not there yet: the kernel creates it (or fails) later
    return None


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
    g.add_argument("--cap-share-user", type=int, default=None,
                   help="capability calls one user's LIPs may have running at once (default: half of "
                        "--cap-workers); a user with none running never waits for other users' calls")
    g.add_argument("--cap-timeout", type=float, default=30.0,
                   help="longest a capability call may take, seconds (default 30; http's own timeout "
                        "may be shorter)")


def _cap_policy(p: argparse.ArgumentParser, args):
    """The capability policy from the kernel's flags (exits with a usage error if one is bad)."""
    from .kernel.capabilities import CapPolicy
    from .ipc.protocol import default_socket_path
    build = os.environ.get("SYMPHONY_BUILD_DIR") or os.path.expanduser("~/.cache/symphony")
    try:
        return CapPolicy.build(allow_read=args.allow_read, deny_read=args.deny_read, allow_http=args.allow_http,
                               kernel_dirs=[args.durable_dir, args.swap_dir, build],
                               socket_path=args.socket or default_socket_path(), workers=args.cap_workers,
                               per_lip=args.cap_share, timeout_s=args.cap_timeout, per_user=args.cap_share_user)
    except (ValueError, RuntimeError) as e:
        p.error(str(e))


def _limit_args(p: argparse.ArgumentParser) -> None:
    """The administrator's ceilings and defaults for every LIP (kernel/loop/limits.py)."""
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
    from .kernel.loop.limits import LimitPolicy
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
    print(f"symphony-kernel: loading the C++ ops (sources: {ops.csrc_dir()})...", file=sys.stderr, flush=True)
    try:
        ops.load()
        t1 = time.perf_counter()
        print(f"symphony-kernel: C++ ops loaded in {t1 - t0:.1f} s; warming up one forward pass...",
              file=sys.stderr, flush=True)
        seq = engine.new_sequence()
        try:
            engine.pred(seq, [0])
        finally:
            engine.release(seq)
    except RuntimeError as e:
        raise StartupError(str(e)) from e
    print(f"symphony-kernel: warm-up forward pass took {time.perf_counter() - t1:.1f} s",
          file=sys.stderr, flush=True)
