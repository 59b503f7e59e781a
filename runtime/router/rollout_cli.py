"""``arbor rollout status|promote|rollback|pause|resume|weight`` against a running router
(its admin API, ``app.py``): what an operator types, and what a script or an outside
controller's step can run.

Exit status: 0 done; 1 the router refused the action (e.g. promoting a complete
rollout); 2 the router has no rollout plan, cannot be reached, or bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

ACTIONS = ("status", "promote", "rollback", "pause", "resume", "weight")


def add_rollout_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cmd = sub.add_parser("rollout", help="show or drive the rollout of a running `arbor router --plan`",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.add_argument("action", choices=ACTIONS, help="what to do: " + ", ".join(ACTIONS))
    cmd.add_argument("value", nargs="?", type=int, default=None, help="weight: the candidate's percent")
    cmd.add_argument("--router", default="http://127.0.0.1:30000", help="the router's base URL")
    cmd.add_argument("--api-key", default=None, help="bearer key of the router")
    cmd.add_argument("--full", action="store_true", help="promote: straight to the last step")
    cmd.add_argument("--reason", default=None, help="rollback / pause: recorded with the event")
    cmd.add_argument("--json", action="store_true", help="print the router's whole JSON answer")
    cmd.set_defaults(func=cmd_rollout)


def cmd_rollout(args: argparse.Namespace) -> int:
    import httpx

    if args.action == "weight" and args.value is None:
        print("arbor rollout weight: give the candidate's percent, e.g. `arbor rollout weight 25`", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.router.rstrip("/") + "/rollout" + ("" if args.action == "status" else f"/{args.action}")
    body: dict[str, Any] = {"full": args.full} if args.action == "promote" else {}
    if args.reason:
        body["reason"] = args.reason
    if args.action == "weight":
        body["weight"] = args.value
    try:
        resp = (httpx.get(url, headers=headers, timeout=10) if args.action == "status"
                else httpx.post(url, json=body, headers=headers, timeout=10))
    except httpx.HTTPError as exc:
        print(f"arbor rollout: cannot reach the router at {args.router}: {exc}", file=sys.stderr)
        return 2
    data = _json(resp)
    if resp.status_code == 404:
        print(f"arbor rollout: the router at {args.router} has no rollout plan "
              "(start it with `arbor router --pool ... --plan FILE`)", file=sys.stderr)
        return 2
    if resp.status_code != 200:
        message = data.get("error", {}).get("message") if isinstance(data, dict) else resp.text
        print(f"arbor rollout {args.action}: refused ({resp.status_code}): {message}", file=sys.stderr)
        return 1 if resp.status_code == 409 else 2
    print(json.dumps(data, indent=2) if args.json else summary(data))
    return 0


def summary(status: dict[str, Any]) -> str:
    """A few lines an operator reads: state, weights, gates, the last events, the panel."""
    weights = ", ".join(f"{pool} {w}%" for pool, w in status["weights"].items())
    lines = [f"state {status['state']} at step {status['step'] + 1}/{status['num_steps']} ({weights})"]
    if status.get("reason"):
        lines.append(f"reason: {status['reason']}")
    for gate in status.get("gates", []):
        value = "n/a" if gate["value"] is None else f"{gate['value']:.4g}"
        lines.append(f"gate {gate['gate']}: {value} over {gate['samples']}/{gate['min_samples']} samples "
                     f"-> {gate['verdict']}")
    for pool, row in status.get("panel", {}).items():
        ttft = row["ttft_s"]
        p50 = "n/a" if ttft["p50"] is None else f"{ttft['p50'] * 1e3:.0f} ms"
        p99 = "n/a" if ttft["p99"] is None else f"{ttft['p99'] * 1e3:.0f} ms"
        lines.append(f"pool {pool}: {row['requests']} requests, {row['errors']} errors, "
                     f"TTFT p50 {p50} p99 {p99} ({ttft['samples']} samples)")
    for event in status.get("events", [])[-5:]:
        lines.append(f"event {event['kind']} step {event['step'] + 1} -> {event['weight']}%: {event['detail']}")
    return "\n".join(lines)


def _json(resp: Any) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None
