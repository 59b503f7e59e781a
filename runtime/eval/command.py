"""The ``arbor eval`` subcommand: flags, targets, the table, the JSON report, the exit code.

    arbor eval --baseline kv_cache_dtype=auto --candidate kv_cache_dtype=int8 \\
        --min-agreement 0.97 --max-kl 0.01 --json report.json
    arbor eval --baseline-url http://prod:30000 --candidate-url http://canary:30000

Exit status: 0 when every gate passes, 1 when one fails, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from runtime.errors import InvalidRequestError
from runtime.eval.report import GATES


def add_eval_parser(sub: Any) -> None:
    ev = sub.add_parser("eval", help="quality replay: compare a candidate with a baseline",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("--model", default="default", help="model of both engines (unless a side sets model=)")
    ev.add_argument("--baseline", default="", metavar="K=V,...",
                    help="the baseline engine's settings (any EngineConfig field), e.g. kv_cache_dtype=auto")
    ev.add_argument("--candidate", default="", metavar="K=V,...", help="the candidate engine's settings")
    ev.add_argument("--common", default="", metavar="K=V,...", help="settings of both engines")
    ev.add_argument("--baseline-url", help="replay on this server as the baseline instead")
    ev.add_argument("--candidate-url", help="replay on this server as the candidate instead")
    ev.add_argument("--api-key", help="bearer key for the servers")
    ev.add_argument("--limit", type=int, default=None, help="at most N samples of each set (quick runs)")
    ev.add_argument("--speed-repeats", type=int, default=3,
                    help="speed runs per side, taken in turns; the table shows medians")
    ev.add_argument("--json", type=Path, dest="json_path", metavar="PATH", help="write the report here")
    for name, (_, _, meaning) in GATES.items():
        ev.add_argument("--" + name.replace("_", "-"), type=float, default=None, help=f"gate: {meaning}")
    ev.set_defaults(func=cmd_eval)


def _target(args: argparse.Namespace, side: str) -> Any:
    from runtime.eval.targets import EngineTarget, ServerTarget, parse_settings

    url = getattr(args, f"{side}_url")
    if url:
        return ServerTarget(url, api_key=args.api_key)
    own = getattr(args, side)
    settings = {"model": args.model, **parse_settings(args.common), **parse_settings(own)}
    return EngineTarget(settings, label=own or "defaults")


def cmd_eval(args: argparse.Namespace) -> int:
    from runtime.eval.run import run_eval
    from runtime.eval.samples import load_samples
    from runtime.eval.targets import parse_settings

    if args.limit is not None and args.limit < 1:
        raise InvalidRequestError("--limit must be >= 1")
    if args.speed_repeats < 1:
        raise InvalidRequestError("--speed-repeats must be >= 1")
    if args.json_path is not None and not args.json_path.parent.is_dir():
        raise InvalidRequestError(f"--json: no directory {args.json_path.parent}")
    for side in ("baseline", "candidate", "common"):  # NOTE: bad settings fail before any load
        parse_settings(getattr(args, side))
    if not args.baseline_url and not args.candidate_url and args.baseline == args.candidate:
        print("arbor eval: note: baseline and candidate have the same settings", file=sys.stderr)
    bounds = {name: getattr(args, name) for name in GATES if getattr(args, name) is not None}
    samples = load_samples().limited(args.limit)
    baseline = _target(args, "baseline")
    try:
        candidate = _target(args, "candidate")
        try:
            report = run_eval(baseline, candidate, samples, bounds, args.speed_repeats)
        finally:
            candidate.close()
    finally:
        baseline.close()
    print(report.table())
    if args.json_path is not None:
        report.write_json(args.json_path)
    return 0 if report.passed else 1
