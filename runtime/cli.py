"""The ``arbor`` command: ``arbor generate "prompt"``, ``arbor serve`` (``--dp N``: N
workers behind a router), ``arbor router --workers URL ...``, ``arbor trace FILE`` and
``arbor eval`` (the quality replay, ``runtime/eval/command.py``).

Every ``EngineConfig`` field is a flag (``max_model_len`` ↔ ``--max-model-len``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

from runtime.config import EngineConfig
from runtime.errors import ArborError
from runtime.eval.command import add_eval_parser
from runtime.model.model_report import add_models_command
from runtime.router.launch import add_router_command, add_router_flags
from runtime.server.launch import add_server_flags


def _flag_type(hint: Any) -> Any:
    """The argparse type for a config field's annotation (``int | None`` → int)."""
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    return hint if hint in (int, float, str) else str


def _default_note(default: Any) -> str:
    return "" if default is None else f" (default {default!r})"


_ALIASES = {"tensor_parallel_size": ("--tp",)}  # SGLang's short names


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field, defaulting to the dataclass's default."""
    hints = get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine settings")
    for f in dataclasses.fields(EngineConfig):
        flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, ())]
        help_text = f.metadata.get("help", "")  # NOTE: tests/runtime/test_cli.py requires one
        if hints[f.name] is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default,
                               help=help_text)
        else:
            group.add_argument(*flags, type=_flag_type(hints[f.name]), default=f.default,
                               help=help_text + _default_note(f.default))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def _cmd_generate(args: argparse.Namespace) -> int:
    from runtime import Engine, SamplingParams  # NOTE: torch loads only for a command that runs


    started = time.perf_counter()
    engine = Engine(**engine_kwargs(args))
    loaded = time.perf_counter()
    prompt = args.prompt
    if args.chat:
        prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed_sample)
    out = engine.generate(prompt, params)[0]
    done = time.perf_counter()
    print(out.text)
    print(f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, load {loaded - started:.1f} s, "
          f"generate {done - loaded:.2f} s]", file=sys.stderr)
    engine.close()
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.node_rank > 0:  # a node that only runs tensor-parallel ranks
        from runtime.distributed.tensor_parallel import run_node

        return run_node(EngineConfig.from_kwargs(**engine_kwargs(args)))
    if args.dp != 1:
        from runtime.router.launch import serve_dp

        return serve_dp(args)
    from runtime.server.launch import serve  # NOTE: the web stack loads only to serve

    return serve(args, engine_kwargs(args))


def _cmd_trace(args: argparse.Namespace) -> int:
    from pathlib import Path

    from runtime import Engine
    from runtime.trace.command import parse_arguments, pick_program, trace_program

    program = pick_program(args.file, args.program)
    arguments = parse_arguments(program, args.args)
    engine = Engine(**engine_kwargs(args))
    try:
        files, trace, error = trace_program(engine, program, arguments, Path(args.out))
    finally:
        engine.close()
    t = trace["totals"]
    print(f"{program.name}: {trace['status']} in {1000 * trace['duration_s']:.0f} ms; {t['generations']} "
          f"generations, {t['prompt_tokens']} prompt tokens ({t['cached_tokens']} cached), "
          f"{t['output_tokens']} generated; {len(trace['streams']) - 1} branches")
    for path in files:
        print(f"wrote {path}")
    if error is not None:
        print(f"arbor: the run failed: {error}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arbor", description="Arbor LLM-program runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap the prompt in the model's chat template (default on)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature; 0 is greedy (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    gen.add_argument("--seed-sample", type=int, default=None, help="sampling seed")
    add_engine_flags(gen)
    gen.set_defaults(func=_cmd_generate)
    srv = sub.add_parser("serve", help="serve the engine over HTTP (native, OpenAI, programs)")
    add_server_flags(srv)
    srv.add_argument("--dp", type=int, default=1,
                     help="data parallelism: N engine worker processes behind a cache-aware router")
    add_router_flags(srv)
    add_engine_flags(srv)
    srv.set_defaults(func=_cmd_serve, serve_parser=srv)
    add_router_command(sub)
    tr = sub.add_parser("trace", help="run a @program of a file once; write its trace (JSON, OTLP) and timeline (SVG)")
    tr.add_argument("file", help="Python file with @program functions (as for serve --programs)")
    tr.add_argument("--program", default=None, help="which program (default: the file's only one)")
    tr.add_argument("--args", default="{}", help="the program's arguments as a JSON object")
    tr.add_argument("--out", default="benchmarks/results/traces", help="directory for the output files")
    add_engine_flags(tr)
    tr.set_defaults(func=_cmd_trace)
    add_eval_parser(sub)
    ref = sub.add_parser("reference", help="print the Markdown reference of every command and flag "
                         "(docs/cli.md is this output)")
    ref.set_defaults(func=_cmd_reference)
    add_models_command(sub)
    return parser


def render_reference(parser: argparse.ArgumentParser | None = None) -> str:
    """The Markdown reference of every ``arbor`` command and flag, read from the parsers
    themselves (so docs/cli.md cannot drift from them: a test compares the two)."""
    parser = parser or build_parser()
    lines = ["# `arbor` command reference", "",
             "Generated by `arbor reference > docs/cli.md` from the parsers; do not edit by hand.", ""]
    shared: dict[str, list[argparse.Action]] = {}  # NOTE: groups several commands take, once
    for name, command in _subcommands(parser).items():
        lines += [f"## `arbor {name}`", "", command.description or _command_help(parser, name), ""]
        for group in command._action_groups:
            rows = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
            title = group.title or ""
            if title in _SHARED_GROUPS:
                shared[title] = rows
                lines += [f"Takes the [{title}](#{title.replace(' ', '-')}).", ""]
            elif rows:
                lines += _flag_table(title, rows)
    for title, rows in shared.items():
        lines += [f"## {title}", "", *_flag_table(None, rows)]
    return "\n".join(lines)


_SHARED_GROUPS = ("engine settings", "router settings")


def _flag_table(title: str | None, rows: list[argparse.Action]) -> list[str]:
    head = [f"**{title}**", ""] if title else []
    return [*head, "| flag | meaning |", "|---|---|",
            *(f"| {_flag_cell(a)} | {_escape(a.help or '')} |" for a in rows), ""]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _command_help(parser: argparse.ArgumentParser, name: str) -> str:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return next((c.help or "" for c in action._choices_actions if c.dest == name), "")


def _flag_cell(action: argparse.Action) -> str:
    names = action.option_strings or [action.dest]
    if isinstance(action, argparse.BooleanOptionalAction):
        names = [n for n in names if not n.startswith("--no-")]
        return ", ".join(f"`{n}` / `--no-{n[2:]}`" for n in names)
    return ", ".join(f"`{n}`" for n in names)


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _cmd_reference(args: argparse.Namespace) -> int:
    print(render_reference(), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command not in ("eval", "router", "reference", "rollout", "models"):  # NOTE: bad settings fail before any load (eval: its own)
            EngineConfig.from_kwargs(**engine_kwargs(args))
        result: int = args.func(args)
        return result
    except ArborError as exc:
        print(f"arbor: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
