"""``arbor serve``: load the engine and the programs, then run the app on uvicorn."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from runtime.server.hosting import load_programs
from runtime.server.limits import ServerLimits

log = logging.getLogger("arbor.server")


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Transport flags of ``arbor serve`` (engine settings are added separately)."""
    group = parser.add_argument_group("server settings")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=30000, help="port to listen on (default 30000)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer <key>' on every route but /health")
    group.add_argument("--programs", default=None,
                       help="Python file whose @program objects clients may run")
    group.add_argument("--served-model-name", default=None, nargs="+",
                       help="the model id(s) of /v1/models; a request's model must be one (else 404)")
    group.add_argument("--log-level", default="info",
                       help="uvicorn and arbor log level: debug, info, warning, error (default info)")
    # NOTE: longer than clients keep idle pooled connections (httpx 5 s, aiohttp 15 s): at
    # uvicorn's 5 s the server closes a connection just as a client reuses it, and that
    # request dies with a reset (the soak test lost a /generate that way).
    group.add_argument("--timeout-keep-alive", type=int, default=75,
                       help="seconds an idle HTTP connection stays open (default 75)")
    defaults = ServerLimits()
    group.add_argument("--max-inflight", type=int, default=defaults.max_inflight,
                       help="requests the engine holds at once; beyond, requests wait "
                            f"(default {defaults.max_inflight})")
    group.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                       help="admitted requests that may wait for their first token; beyond, 503 with "
                            f"Retry-After (default {defaults.max_waiting})")
    group.add_argument("--max-queue-wait", type=_seconds_or_none, default=defaults.max_queue_wait_s,
                       help="a request that would wait longer than this many seconds for its first token, "
                            "by the server's measured pace, is refused at once with 429 and Retry-After; "
                            f"'none': no such bound (default {defaults.max_queue_wait_s:g})")
    group.add_argument("--queue-wait-share", type=float, default=defaults.queue_wait_deadline_share,
                       help="a request that would wait for its first token longer than this share of its own "
                            "deadline (its timeout, else --request-timeout) is refused at once with 429 and "
                            "Retry-After "
                            f"(default {defaults.queue_wait_deadline_share:g})")
    group.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                       help=f"largest request body accepted; beyond, 413 (default {defaults.max_body_bytes})")
    group.add_argument("--max-tokens-limit", type=int, default=defaults.max_tokens,
                       help="cap on the tokens one request may ask for")
    group.add_argument("--default-max-tokens", type=int, default=defaults.default_max_tokens,
                       help="tokens generated when a request does not say "
                            f"(default {defaults.default_max_tokens})")
    group.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s,
                       help="seconds a request or program run may take before it is aborted "
                            f"(default {defaults.request_timeout_s})")
    group.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens,
                       help="prompt tokens of one request (default: the model's context)")
    group.add_argument("--tenant-max-concurrent", type=int, default=defaults.tenant_max_concurrent,
                       help="requests in flight per tenant (X-Tenant header / OpenAI user field)")
    group.add_argument("--tenant-tokens-per-minute", type=int, default=defaults.tenant_tokens_per_minute,
                       help="prompt + max_tokens per tenant per minute")
    group.add_argument("--tenant-slo", type=_tenant_slo, action="append", default=[],
                       metavar="TENANT=TTFT,ITL",
                       help="latency targets of one tenant in seconds ('none': the engine's), e.g. "
                            "'batch=30,none'; repeatable; a request's own targets win")
    group.add_argument("--fault-delay-ms", type=float, default=0.0,
                       help="TEST HOOK: delay every generation request by this many ms (shows a "
                            "rollout's rollback against a slow worker; never in production)")
    group.add_argument("--unknown-fields", choices=("error", "warn"), default=defaults.unknown_fields,
                       help="a request field the server does not understand: 'error' (400 naming it, "
                            "the default) or 'warn' (ignored, named in the X-Arbor-Ignored-Fields header)")
    group.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout_s,
                       help="on SIGTERM, seconds in-flight requests may take before they are aborted")
    group.add_argument("--body-timeout", type=float, default=defaults.body_timeout_s,
                       help="seconds a request body may take to arrive whole; later: 408 (default %(default)s)")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(max_inflight=args.max_inflight, max_waiting=args.max_waiting,
                        max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens_limit,
                        default_max_tokens=args.default_max_tokens,
                        request_timeout_s=args.request_timeout, program_timeout_s=args.request_timeout,
                        max_prompt_tokens=args.max_prompt_tokens,
                        tenant_max_concurrent=args.tenant_max_concurrent,
                        tenant_tokens_per_minute=args.tenant_tokens_per_minute,
                        tenant_slo=tuple(args.tenant_slo),
                        shutdown_timeout_s=args.shutdown_timeout,
                        unknown_fields=args.unknown_fields, body_timeout_s=args.body_timeout,
                        max_queue_wait_s=args.max_queue_wait,
                        queue_wait_deadline_share=args.queue_wait_share)


def _tenant_slo(text: str) -> tuple[str, float | None, float | None]:
    """``TENANT=TTFT,ITL`` (seconds > 0, or 'none') as a ``ServerLimits.tenant_slo`` entry."""
    tenant, eq, targets = text.rpartition("=")
    parts = targets.split(",")
    if not eq or not tenant or len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected TENANT=TTFT,ITL (seconds or 'none'), got {text!r}")
    ttft, itl = (_seconds_or_none(p) for p in parts)
    if any(t is not None and not t > 0 for t in (ttft, itl)):
        raise argparse.ArgumentTypeError(f"latency targets must be > 0 seconds or 'none', got {text!r}")
    return tenant, ttft, itl


def _seconds_or_none(text: str) -> float | None:
    """A CLI value in seconds, or 'none'."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'none', got {text!r}") from None


def serve(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Build the engine and the app from parsed flags and serve until interrupted."""
    # NOTE: here, not at the top: `arbor --help` and `arbor generate` parse these flags
    # and must not load the web stack (or torch, through the engine) to do so.
    from runtime import Engine
    from runtime.server.app import create_app
    from runtime.server.shutdown import GracefulServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    programs = load_programs(args.programs) if args.programs else {}
    engine = Engine(**engine_kwargs)
    limits = limits_from_args(args)
    app = create_app(engine, programs=programs, api_key=args.api_key,
                     limits=limits, model_name=args.served_model_name)
    if getattr(args, "fault_delay_ms", 0.0) > 0:
        from runtime.server.fault import FaultDelayMiddleware

        log.warning("TEST HOOK --fault-delay-ms %g: every generation request is delayed", args.fault_delay_ms)
        app.add_middleware(FaultDelayMiddleware, delay_s=args.fault_delay_ms / 1000)
    log.info("serving %s on http://%s:%d (%d programs, config version %s)", engine.config.model,
             args.host, args.port, len(programs), engine.config.version())
    server = GracefulServer(app, app.state.ctx.gate, engine, limits.shutdown_timeout_s,
                            host=args.host, port=args.port, log_level=args.log_level.lower(),
                            timeout_keep_alive=args.timeout_keep_alive)
    try:
        server.run()
    finally:
        engine.close()  # NOTE: aborts (with an error) whatever the drain left
    log.info("shut down")
    return 0

