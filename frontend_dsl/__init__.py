"""Arbor's frontend language: typed, async LLM programs over an abstract backend.

    from frontend_dsl import program, gen, select, system, user, assistant, tool
    from frontend_dsl import set_default_backend

    @program
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=32, temperature=0))

How it runs: appending to a state adds nodes to a request graph (``graph.py``) and
submits them at once (``tracer.py``, ``executor.py``); only reads (``s["x"]``,
``s.text()``) wait, and ``s.ref("x")`` does not (``ref.py``). ``program.trace(...)``
builds the graph without running anything: reads that flow into later prompts become
edges, and it ends at the first use of a generated value in control flow.
``frontend_dsl.sgl`` gives the same DSL under SGLang's names. Token ids grow by the boundary rule of
``tokens.py``; roles are cut from the chat template (``roles.py``). The model is reached
only through a ``Backend`` (``backend.py``; ``default_backend.py`` picks a run's):
``EngineBackend`` (in-process), ``RuntimeEndpoint(url)`` (a remote ``arbor serve``),
``OpenAIBackend(base_url, model)`` (any OpenAI-compatible server) or ``FakeBackend``
(tests). A ``Program`` is also what ``arbor serve --programs`` hosts: it satisfies the
server's hosting protocol (``hosting.py``).
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
from frontend_dsl.primitives import (
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    select,
    system_begin,
    system_end,
    user_begin,
    user_end,
)
from frontend_dsl.program import Program, program
from frontend_dsl.program_limits import ProgramLimits
from frontend_dsl.ref import Ref
from frontend_dsl.roles import assistant, system, user
from frontend_dsl.run_trace import RunTrace
from frontend_dsl.state import Branches, ProgramState
from frontend_dsl.tools import Tool, ToolCall, tool

__all__ = [
    "Backend", "Branches", "DSLError", "GenChunk", "GenParams", "GenerationError", "Graph",
    "Node", "Program", "ProgramCancelledError", "ProgramDefinitionError", "ProgramError",
    "ProgramLimitError", "ProgramLimits", "ProgramState", "Ref", "RunTrace", "Tool", "ToolCall", "assistant", "assistant_begin",
    "assistant_end", "gen", "gen_int", "gen_string", "get_default_backend", "program", "select",
    "set_default_backend", "system", "system_begin", "system_end", "tool", "user", "user_begin",
    "user_end",
]


def __getattr__(name: str) -> object:
    # RuntimeEndpoint and OpenAIBackend pull in the HTTP client stack; import them only
    # when asked for.
    if name == "RuntimeEndpoint":
        from frontend_dsl.runtime_endpoint import RuntimeEndpoint

        return RuntimeEndpoint
    if name == "OpenAIBackend":
        from frontend_dsl.openai_backend import OpenAIBackend

        return OpenAIBackend
    raise AttributeError(f"module 'frontend_dsl' has no attribute {name!r}")
