"""The ``arbor`` command line: every flag explains itself, and docs/cli.md is the parsers."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from runtime.cli import build_parser, render_reference

ROOT = Path(__file__).resolve().parents[2]


def _flags_without_help(parser: argparse.ArgumentParser, path: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += _flags_without_help(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction) and not (action.help or "").strip():
            missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_flag_of_every_command_has_help_text() -> None:
    assert _flags_without_help(build_parser(), "arbor") == []


@pytest.mark.parametrize("command", ["serve", "router", "eval", "trace", "generate"])
def test_help_prints_for_each_command(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: arbor " + command in out


def test_engine_settings_take_their_help_from_the_config_fields() -> None:
    text = render_reference()
    assert "| `--weights` | how the weights are held:" in text
    assert "| `--disable-prefix-cache` / `--no-disable-prefix-cache` |" in text


def test_the_generated_reference_is_docs_cli_md() -> None:
    """Regenerate with ``arbor reference > docs/cli.md`` after changing a flag."""
    assert (ROOT / "docs" / "cli.md").read_text() == render_reference()
