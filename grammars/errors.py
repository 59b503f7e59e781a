"""The one error type of the grammar front end."""

from __future__ import annotations


class ConstraintError(ValueError):
    """A constraint that cannot be turned into a grammar.

    Raised for an invalid JSON schema, an invalid regex, a grammar syntax error (the
    message names the line and column), an unsupported schema feature, an unknown
    constraint type, and (by ``runtime.constrained``) a compilation that fails or times out.
    """
