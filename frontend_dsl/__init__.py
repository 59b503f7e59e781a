"""Arbor's frontend language: typed, async LLM programs over an abstract backend.

    from frontend_dsl import program, gen, select, system, user, assistant, tool
    from frontend_dsl import set_default_backend

    @program
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=32, temperature=0))

How it runs: appending to a state adds nodes to a request graph (``graph.py``) and
submits them at once (``tracer.py``, ``executor.py``); only reads (``s["x"]``,
``s.text()``) wait. ``program.trace(...)`` builds the graph without running anything and
ends it at the first read of a generated value. Token ids grow by the boundary rule of
``tokens.py``; roles are cut from the chat template (``roles.py``). The model is reached
only through a ``Backend`` (``backend.py``; ``default_backend.py`` picks a run's):
``EngineBackend`` (in-process), ``RuntimeEndpoint(url)`` (a remote ``arbor serve``) or
``FakeBackend`` (tests). A ``Program`` is also what ``arbor serve --programs`` hosts: it
satisfies the server's hosting protocol (``hosting.py``).
"""

from frontend_dsl.backend import Backend, GenChunk, GenParams
from frontend_dsl.default_backend import get_default_backend, set_default_backend
from frontend_dsl.errors import (
    DSLError,
    GenerationError,
    ProgramCancelledError,
    ProgramDefinitionError,
    ProgramError,
    ProgramLimitError,
)
from frontend_dsl.graph import Graph, Node
from frontend_dsl.limits import ProgramLimits
from frontend_dsl.primitives import gen, select
from frontend_dsl.program import Program, program
from frontend_dsl.roles import assistant, system, user
from frontend_dsl.state import Branches, ProgramState
from frontend_dsl.tools import Tool, ToolCall, tool

__all__ = [
    "Backend", "Branches", "DSLError", "GenChunk", "GenParams", "GenerationError", "Graph",
    "Node", "Program", "ProgramCancelledError", "ProgramDefinitionError", "ProgramError",
    "ProgramLimitError", "ProgramLimits", "ProgramState", "Tool", "ToolCall", "assistant", "gen", "get_default_backend", "program",
    "select", "set_default_backend", "system", "tool", "user",
]


def __getattr__(name: str) -> object:
    # RuntimeEndpoint pulls in the HTTP client stack; import it only when asked for.
    if name == "RuntimeEndpoint":
        from frontend_dsl.runtime_endpoint import RuntimeEndpoint

        return RuntimeEndpoint
    raise AttributeError(f"module 'frontend_dsl' has no attribute {name!r}")
