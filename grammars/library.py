"""Lark grammars shipped in this package: ``load_grammar("json")`` and friends."""

from __future__ import annotations

from pathlib import Path

from grammars.constraints import GrammarConstraint
from grammars.errors import ConstraintError

GRAMMAR_DIR = Path(__file__).resolve().parent


def shipped_grammars() -> list[str]:
    """Names of the shipped grammars (file stems), sorted."""
    return sorted(p.stem for p in GRAMMAR_DIR.glob("*.lark"))


def load_grammar(name: str) -> GrammarConstraint:
    """The shipped grammar ``name`` (``"json"`` or ``"json.lark"``) as a constraint.

    Raises:
        ConstraintError: no shipped grammar has that name.
    """
    stem = name.removesuffix(".lark")
    path = GRAMMAR_DIR / f"{stem}.lark"
    if "/" in stem or not path.is_file():
        raise ConstraintError(
            f"unknown grammar {name!r}; shipped grammars: {', '.join(shipped_grammars())}"
        )
    return GrammarConstraint(path.read_text(encoding="utf-8"), name=stem)


def grammar_from_file(path: Path) -> GrammarConstraint:
    """A ``.lark`` file anywhere on disk as a constraint (validated)."""
    if path.suffix != ".lark":
        raise ConstraintError(f"grammar files must end in .lark, got {str(path)!r}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConstraintError(f"cannot read grammar file {str(path)!r}: {exc}") from None
    return GrammarConstraint(text, name=path.name)
