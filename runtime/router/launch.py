"""``arbor router --workers URL ...`` (or ``--pool NAME=URL,... --plan FILE``: a rollout),
``arbor rollout status|promote|rollback|pause|resume`` and ``arbor serve --dp N``.

``--dp N`` starts N ``arbor serve`` worker processes (each its own engine and KV pool) on
free loopback ports with the same engine and server flags, waits until each answers
``/health``, then serves the router on ``--host``/``--port``. A worker process that exits
is started again on its port (the router's health probes take it out meanwhile and bring
it back when it answers). Without ``--num-threads``, each worker gets an equal share of
the CPU cores, so N workers do not oversubscribe the machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path

from runtime.distributed.child_watch import StderrTail, exit_message
from runtime.errors import ArborError, InvalidRequestError
from runtime.router.config import POLICY_NAMES, HealthConfig, PolicyConfig

log = logging.getLogger("arbor.router")
START_TIMEOUT_S = 900.0  # a worker's model load (the default model's first conversion included)
# Flags of `arbor serve` that belong to the router, never passed to a --dp worker.
ROUTER_DESTS = frozenset({"dp", "host", "port", "command", "func", "serve_parser"}
                         | {"router_policy", "health_interval", "health_timeout", "health_failures",
                            "router_index_capacity", "router_share_across_tenants"}
                         | {f.name for f in fields(PolicyConfig)})


def add_router_flags(parser: argparse.ArgumentParser) -> None:
    """Routing and health flags (``arbor router`` and ``arbor serve --dp``)."""
    p, h = PolicyConfig(), HealthConfig()
    group = parser.add_argument_group("router settings")
    group.add_argument("--router-policy", choices=POLICY_NAMES, default=p.policy,
                       help=f"how a worker is chosen for a request (default {p.policy})")
    group.add_argument("--cache-threshold", type=float, default=p.cache_threshold,
                       help="share of a request's prefix a worker must hold to be chosen for it")
    group.add_argument("--balance-abs-threshold", type=int, default=p.balance_abs_threshold,
                       help="in-flight requests above the least loaded worker before the cache is ignored")
    group.add_argument("--balance-rel-threshold", type=float, default=p.balance_rel_threshold,
                       help="... and this many times its load")
    group.add_argument("--router-index-capacity", type=int, default=p.index_capacity,
                       help="characters (or token ids) of prefixes remembered per worker")
    group.add_argument("--hash-prefix-len", type=int, default=p.hash_prefix_len,
                       help="consistent_hash: leading characters hashed")
    group.add_argument("--router-share-across-tenants", action=argparse.BooleanOptionalAction,
                       default=p.share_across_tenants,
                       help="the workers run with --share-prefix-cache-across-tenants: route one "
                       "tenant's prompt to a worker another tenant sent it to (implied by that flag "
                       "under `arbor serve --dp`)")
    group.add_argument("--health-interval", type=float, default=h.interval_s, help="seconds between probes")
    group.add_argument("--health-timeout", type=float, default=h.timeout_s, help="seconds a probe may take")
    group.add_argument("--health-failures", type=int, default=h.failures_to_remove,
                       help="failed probes in a row that take a worker out")


def add_router_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cmd = sub.add_parser("router", help="route requests over running `arbor serve` workers")
    cmd.add_argument("--workers", nargs="+", default=None, metavar="URL",
                     help="base URLs of the workers, e.g. http://10.0.0.2:30000")
    cmd.add_argument("--pool", action="append", default=None, metavar="NAME=URL[,URL]",
                     help="a named pool of workers (repeat: --pool baseline=URL --pool candidate=URL)")
    cmd.add_argument("--plan", type=Path, default=None, metavar="FILE",
                     help="rollout plan (JSON or TOML; docs/rollouts.md) over the --pool pools")
    cmd.add_argument("--rollout-db", default="arbor_rollout.sqlite", metavar="PATH",
                     help="SQLite file keeping the rollout's state across restarts (':memory:': none)")
    cmd.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    cmd.add_argument("--port", type=int, default=30000, help="port to listen on (default 30000)")
    cmd.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer <key>' (relayed to the workers)")
    cmd.add_argument("--max-body-bytes", type=int, default=None,
                     help="largest request body accepted; beyond, 413 (default: no bound)")
    cmd.add_argument("--log-level", default="info",
                     help="uvicorn and arbor log level: debug, info, warning, error (default info)")
    add_router_flags(cmd)
    cmd.set_defaults(func=run_router)
    from runtime.router.rollout_cli import add_rollout_command

    add_rollout_command(sub)


def policy_from_args(args: argparse.Namespace) -> PolicyConfig:
    return PolicyConfig(policy=args.router_policy, cache_threshold=args.cache_threshold,
                        balance_abs_threshold=args.balance_abs_threshold,
                        balance_rel_threshold=args.balance_rel_threshold,
                        index_capacity=args.router_index_capacity, hash_prefix_len=args.hash_prefix_len,
                        share_across_tenants=args.router_share_across_tenants
                        or getattr(args, "share_prefix_cache_across_tenants", False))


def health_from_args(args: argparse.Namespace) -> HealthConfig:
    return HealthConfig(interval_s=args.health_interval, timeout_s=args.health_timeout,
                        failures_to_remove=args.health_failures)


def run_router(args: argparse.Namespace, worker_urls: list[str] | None = None) -> int:
    """Serve the router in front of ``worker_urls`` (default: ``--workers``) until interrupted."""
    import uvicorn

    from runtime.router.app import create_router_app
    from runtime.router.pools import Pools
    from runtime.router.rollout_plan import load_plan
    from runtime.router.rollout_store import RolloutStore

    pool_specs = getattr(args, "pool", None)
    plan_path = getattr(args, "plan", None)
    if pool_specs and (worker_urls or args.workers):
        raise InvalidRequestError("give either --workers or --pool, not both")
    pools, urls = Pools.parse(pool_specs) if pool_specs else (None, worker_urls or args.workers or [])
    if not urls:
        raise InvalidRequestError("no workers: give --workers URL ... or --pool NAME=URL ...")
    if plan_path is not None and pools is None:
        raise InvalidRequestError("a rollout plan needs named pools (--pool baseline=URL --pool candidate=URL)")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise InvalidRequestError(f"a worker URL must start with http:// or https://, got {url!r}")
    plan = load_plan(plan_path, pools.names) if plan_path is not None and pools is not None else None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    store = RolloutStore(args.rollout_db) if plan is not None else None
    app = create_router_app(urls, policy_from_args(args), health_from_args(args), api_key=args.api_key,
                            max_body_bytes=args.max_body_bytes, pools=pools, plan=plan, store=store)
    log.info("routing http://%s:%d over %d workers (%s)", args.host, args.port, len(urls), args.router_policy)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=5)
    return 0


def worker_argv(args: argparse.Namespace, serve_parser: argparse.ArgumentParser) -> list[str]:
    """The ``arbor serve`` flags a ``--dp`` worker gets: every flag given that is not the
    router's (``--dp``, ``--host``, ``--port``, routing and health flags)."""
    argv: list[str] = []
    for action in serve_parser._actions:
        dest = action.dest
        if not action.option_strings or dest in ROUTER_DESTS or dest == "help":
            continue
        value = getattr(args, dest, action.default)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0] if value else action.option_strings[1])
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class WorkerProcesses:
    """N ``arbor serve`` processes on loopback ports, restarted when one exits."""

    def __init__(self, argv: list[str], num_workers: int) -> None:
        self.argv = argv
        self.ports = [free_port() for _ in range(num_workers)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.tails: dict[int, StderrTail] = {}
        self.procs = [self._spawn(i) for i in range(num_workers)]
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="arbor-dp-watch", daemon=True)

    def _spawn(self, i: int) -> subprocess.Popen[bytes]:
        """Start worker ``i``; its stderr is copied to ours and its last lines kept."""
        cmd = [sys.executable, "-m", "runtime.cli", "serve", *self.argv,
               "--host", "127.0.0.1", "--port", str(self.ports[i])]
        log.info("starting worker %d: %s", i, " ".join(cmd[1:]))
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        self.tails[i] = StderrTail(proc.stderr, f"arbor-dp-worker{i}")
        return proc

    def exit_report(self, i: int) -> str:
        """How worker ``i`` ended, with the last lines of its stderr."""
        return exit_message(f"worker {i} ({self.urls[i]})", self.procs[i].returncode, self.tails[i].text())

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until every worker answers /health; raise if one exits first."""
        import httpx

        deadline = time.monotonic() + timeout_s
        pending = set(range(len(self.procs)))
        while pending:
            for i in sorted(pending):
                if self.procs[i].poll() is not None:
                    raise ArborError(f"{self.exit_report(i)}\n(while starting: no worker is serving)")
                try:
                    if httpx.get(f"{self.urls[i]}/health", timeout=2).status_code == 200:
                        pending.discard(i)
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise ArborError(f"workers {sorted(pending)} did not answer /health within {timeout_s:.0f} s")
            time.sleep(0.5)
        self.watcher.start()

    def _watch(self) -> None:
        """Start a worker that exited again; one that keeps dying within a minute of its
        start waits twice as long each time (up to a minute) rather than spinning."""
        started = [time.monotonic()] * len(self.procs)
        delay = [1.0] * len(self.procs)
        while not self.stopping.wait(1.0):
            for i, proc in enumerate(self.procs):
                if proc.poll() is None or self.stopping.is_set():
                    continue
                quick = time.monotonic() - started[i] < 60.0
                delay[i] = min(60.0, delay[i] * 2) if quick else 1.0
                log.error("%s\nstarting it again in %.0f s", self.exit_report(i), delay[i])
                if self.stopping.wait(delay[i]):
                    return
                self.procs[i] = self._spawn(i)
                started[i] = time.monotonic()

    def stop(self) -> None:
        self.stopping.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def serve_dp(args: argparse.Namespace) -> int:
    """``arbor serve --dp N``: N workers and the router in front of them."""
    if args.dp < 1:
        raise InvalidRequestError(f"--dp must be a positive number of workers, got {args.dp}")
    policy_from_args(args), health_from_args(args)  # NOTE: bad router settings fail before any load
    argv = worker_argv(args, args.serve_parser)
    if args.num_threads is None:
        argv += ["--num-threads", str(max(1, (os.cpu_count() or 1) // args.dp))]
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    workers = WorkerProcesses(argv, args.dp)
    try:
        workers.wait_ready()
        return run_router(args, workers.urls)
    finally:
        workers.stop()
