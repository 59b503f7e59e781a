"""``arbor serve --dp`` and ``arbor router`` flags: what a worker gets, what the router keeps."""

from __future__ import annotations

import pytest

from runtime.cli import build_parser, main
from runtime.router.launch import health_from_args, policy_from_args, worker_argv


def test_dp_workers_get_every_engine_and_server_flag_but_the_routers() -> None:
    args = build_parser().parse_args([
        "serve", "--dp", "2", "--model", "m", "--port", "9000", "--host", "0.0.0.0", "--api-key", "k",
        "--max-prefill-tokens", "256", "--no-prepack-weights", "--disable-prefix-cache",
        "--router-policy", "round_robin", "--health-interval", "0.5", "--cache-threshold", "0.25"])
    argv = worker_argv(args, args.serve_parser)
    assert argv == ["--api-key", "k", "--model", "m", "--max-prefill-tokens", "256",
                    "--disable-prefix-cache", "--no-prepack-weights"]
    assert policy_from_args(args).policy == "round_robin" and policy_from_args(args).cache_threshold == 0.25
    assert health_from_args(args).interval_s == 0.5


def test_router_command_flags() -> None:
    args = build_parser().parse_args(["router", "--workers", "http://a:1", "http://b:2", "--port", "8080",
                                      "--balance-abs-threshold", "4"])
    assert args.workers == ["http://a:1", "http://b:2"] and args.port == 8080
    assert policy_from_args(args).balance_abs_threshold == 4


@pytest.mark.parametrize(("argv", "message"), [
    (["router", "--workers", "a:1"], "must start with http://"),
    (["router", "--workers", "http://a:1", "--cache-threshold", "2"], "cache_threshold"),
    (["serve", "--dp", "0"], "--dp must be a positive"),
])
def test_bad_router_settings_fail_with_a_message(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_tensor_parallel_flags() -> None:
    from runtime.cli import engine_kwargs

    args = build_parser().parse_args(["serve", "--tp", "2", "--nnodes", "2", "--node-rank", "1",
                                      "--dist-init-addr", "10.0.0.1:5000", "--dist-timeout-s", "30"])
    kwargs = engine_kwargs(args)
    assert (kwargs["tensor_parallel_size"], kwargs["nnodes"], kwargs["node_rank"]) == (2, 2, 1)
    assert (kwargs["dist_init_addr"], kwargs["dist_timeout_s"]) == ("10.0.0.1:5000", 30.0)


def test_a_second_node_needs_the_rendezvous_address(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--tp", "2", "--nnodes", "2", "--node-rank", "1"]) == 2
    assert "dist_init_addr" in capsys.readouterr().err
