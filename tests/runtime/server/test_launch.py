"""``arbor serve`` flags: every engine setting, the server's own, and the limits."""

from __future__ import annotations

from runtime.cli import build_parser, engine_kwargs
from runtime.server.launch import limits_from_args


def test_serve_flags_map_to_engine_settings_and_limits() -> None:
    args = build_parser().parse_args([
        "serve", "--model", "default", "--programs", "examples/programs.py", "--host", "0.0.0.0",
        "--port", "8123", "--api-key", "k", "--max-prefill-tokens", "256", "--disable-prefix-cache",
        "--max-inflight", "7", "--request-timeout", "12.5", "--queue-wait-share", "0.5"])
    assert (args.host, args.port, args.api_key, args.programs) == ("0.0.0.0", 8123, "k", "examples/programs.py")
    kwargs = engine_kwargs(args)
    assert kwargs["max_prefill_tokens"] == 256 and kwargs["disable_prefix_cache"] is True
    limits = limits_from_args(args)
    assert (limits.max_inflight, limits.request_timeout_s) == (7, 12.5)
    assert limits.queue_wait_deadline_share == 0.5
