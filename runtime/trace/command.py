"""``arbor trace FILE``: run one program of FILE on an in-process engine and write its trace.

The file is loaded as ``arbor serve --programs`` loads it (``server.hosting.load_programs``:
every ``@program`` in it), and the program runs through the same hosting protocol, so the
runtime needs nothing of the DSL. Three files are written, named after the program:

    <out>/<program>.trace.json   the run's trace (format ``arbor.run_trace/1``)
    <out>/<program>.otlp.json    the same as OpenTelemetry spans (OTLP/JSON)
    <out>/<program>.svg          its timeline

A failed run still writes its (partial) trace, then reports the failure.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from runtime.errors import InvalidRequestError
from runtime.server.hosting import (
    HostedProgram,
    InvalidArgumentsError,
    ProgramOutcome,
    ProgramRunFailedError,
    load_programs,
)
from runtime.trace.otel import otel_spans, otlp_document
from runtime.trace.timeline import render_timeline


def pick_program(path: str | Path, name: str | None) -> HostedProgram:
    """The program ``name`` of the file (or its only one)."""
    programs = load_programs(path)
    if name is not None:
        if name not in programs:
            raise InvalidRequestError(f"{path} has no program {name!r} (it has: {sorted(programs) or 'none'})")
        return programs[name]
    if len(programs) != 1:
        raise InvalidRequestError(f"{path} has {len(programs)} programs ({sorted(programs)}); pick one with --program")
    return next(iter(programs.values()))


def parse_arguments(program: HostedProgram, text: str) -> dict[str, Any]:
    """The ``--args`` JSON object, checked by the program."""
    try:
        arguments = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"--args is not JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise InvalidRequestError("--args must be a JSON object of the program's arguments")
    try:
        return program.validate_arguments(arguments)
    except InvalidArgumentsError as exc:
        raise InvalidRequestError(f"arguments of {program.name}: {exc}") from None


async def run_once(program: HostedProgram, engine: Any, arguments: dict[str, Any]) -> ProgramOutcome:
    """Run the program to its outcome (``ProgramRunFailedError`` if it failed)."""
    async for event in program.run_hosted(engine, arguments):
        if isinstance(event, ProgramOutcome):
            return event
    raise ProgramRunFailedError(f"program {program.name} ended without a result")


def write_trace(trace: dict[str, Any], out_dir: Path, name: str) -> list[Path]:
    """The three files of the module docstring; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {out_dir / f"{name}.trace.json": json.dumps(trace, indent=2, default=str),
             out_dir / f"{name}.otlp.json": json.dumps(otlp_document(otel_spans(trace)), indent=1),
             out_dir / f"{name}.svg": render_timeline(trace)}
    for path, text in files.items():
        path.write_text(text)
    return list(files)


def trace_program(engine: Any, program: HostedProgram, arguments: dict[str, Any],
                  out_dir: Path) -> tuple[list[Path], dict[str, Any], str | None]:
    """Run and write the trace: (files, trace, the failure's message or None)."""
    try:
        outcome = asyncio.run(run_once(program, engine, arguments))
        trace, error = outcome.trace, None
    except ProgramRunFailedError as exc:
        trace, error = exc.trace, str(exc)
    if trace is None:
        raise InvalidRequestError(f"program {program.name} reported no trace" + (f" ({error})" if error else ""))
    return write_trace(trace, out_dir, program.name), trace, error
