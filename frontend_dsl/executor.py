"""Runs request-graph nodes on a backend.

Each submitted node becomes a task that waits for its dependencies and then runs, so every
node whose inputs are ready is in flight at once: sibling branches reach the backend
together and are batched there. A node whose dependency failed fails with the same
exception; other streams carry on. All methods run on the DSL loop thread
(``Session`` submits through ``call_soon_threadsafe``). ``_run`` is the one place where a
node starts (its dependencies done) and ends (result or exception set).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from frontend_dsl.backend import Backend, GenChunk
from frontend_dsl.choices import decide
from frontend_dsl.errors import GenerationError, ProgramCancelledError
from frontend_dsl.graph import Node
from frontend_dsl.healing import healing_plan
from frontend_dsl.output_constraint import parse_output
from frontend_dsl.primitives import DTYPES, Gen, Select
from frontend_dsl.reasoning import REASONING_KEY, split_thinking
from frontend_dsl.ref import Ref, value_text
from frontend_dsl.run_trace import RunRecorder
from frontend_dsl.stream_data import StreamData
from frontend_dsl.tools import execute_call

# (stream_id, variable being generated or None, new text, the variable is finished),
# called on the loop for every piece of text a stream gets, in order.
TextListener = Callable[[int, "str | None", str, bool], None]


@dataclasses.dataclass(frozen=True)
class TextPayload:
    """What a text node does besides appending: open or close a chat message."""

    role_event: str | None = None  # "begin" | "end" | None
    role: str | None = None


@dataclasses.dataclass(frozen=True)
class ForkPayload:
    branch_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class JoinPayload:
    branch_ids: tuple[int, ...]
    mode: str  # "gather" | "concat"


@dataclasses.dataclass(frozen=True)
class SetPayload:
    name: str
    value: Any


@dataclasses.dataclass(frozen=True)
class CapturePayload:
    name: str
    event: str  # "begin" | "end"


class Executor:
    """Executes nodes of one program run against ``backend``."""

    def __init__(self, backend: Backend, on_text: TextListener | None = None) -> None:
        self.backend = backend
        self.streams: dict[int, StreamData] = {0: StreamData()}
        self.thinking: dict[int, str] = {}  # gen(reasoning=...): each node's thinking span, by node id
        self._on_text = on_text
        self._tasks: set[asyncio.Task[None]] = set()
        self.recorder = RunRecorder()  # node timings and costs: the run's trace (run_trace.py)
        # Sent with every request of the run, so the backend keeps the states the run will
        # extend (a tool call's, a fork's) until ``end_run`` (runtime/cache/retention.py).
        self.run_id = f"run-{uuid.uuid4().hex}"
        self._handlers: dict[str, Callable[[Node], Awaitable[Any]]] = {
            "text": self._text, "gen": self._gen, "select": self._select,
            "fork": self._fork, "join": self._join, "tool_call": self._tool_call,
            "var": self._var, "set": self._set, "capture": self._capture,
        }

    def submit(self, node: Node, deps: list[Node]) -> None:
        """Start ``node`` as soon as ``deps`` are done."""
        task = asyncio.ensure_future(self._run(node, deps))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: _fail_if_pending(node))

    def end_run(self) -> None:
        """The run ended (its body returned, every node finished): release what the
        backend kept for it. Thread-safe."""
        self.backend.end_run(self.run_id)

    def cancel_all(self) -> None:
        """Cancel every node still pending or running."""
        for task in list(self._tasks):
            task.cancel()

    async def _run(self, node: Node, deps: list[Node]) -> None:
        try:
            for dep in deps:
                # NOTE: shielded. A bare wrap_future chains cancellation back: cancelling this
                # task (the body raised) cancelled the dependency's own ``done`` while still
                # pending, and concurrent.futures.wait never counts such a future as done,
                # so Session.wait_all hung forever (found by tests/frontend_dsl/test_program_fuzz.py).
                await asyncio.shield(asyncio.wrap_future(dep.done))
            self.recorder.start(node)
            result = await self._handlers[node.kind](node)
        except asyncio.CancelledError:
            self._finish(node, exc=ProgramCancelledError(f"node {node.id} cancelled"))
        except Exception as exc:  # noqa: BLE001 - recorded on the node, surfaced to readers
            self._finish(node, exc=exc)
        else:
            self._finish(node, result=result)

    def _finish(self, node: Node, result: Any = None, exc: BaseException | None = None) -> None:
        if node.id in self.recorder.records:  # it started
            self.recorder.end(node, exc)
        if exc is not None:
            node.done.set_exception(exc)
        else:
            node.done.set_result(result)

    def _emit(self, stream_id: int, text: str, var: str | None = None, final: bool = False) -> None:
        if self._on_text is not None and (text or final):
            self._on_text(stream_id, var, text, final)

    # ---- handlers: one per node kind; each returns the node's value ----

    async def _text(self, node: Node) -> None:
        data = self.streams[node.stream_id]
        payload: TextPayload = node.payload
        if payload.role_event == "end":
            data.end_message()
        data.append_text(node.attrs["text"], self.backend)
        self._emit(node.stream_id, node.attrs["text"])
        if payload.role_event == "begin":
            assert payload.role is not None
            data.begin_message(payload.role)

    async def _gen(self, node: Node) -> Any:
        spec: Gen = node.payload
        data = self.streams[node.stream_id]
        prompt_len = len(data.ids)
        final, text = await self._generate(node.stream_id, data, spec)
        meta = _gen_meta(final, prompt_len)
        self.recorder.generated(node, meta)
        cut_at = spec.params.max_tokens if final.finish_reason == "length" else None
        if spec.reasoning_var is not None:  # the state keeps it all; the value is the answer
            text = self._split_thinking(node, data, spec, text, cut_at)
        value = parse_output(text, spec.params.constraint, cut_at, final.constraint_check)
        if spec.dtype is not None:
            value = DTYPES[spec.dtype][1](text)
        elif spec.as_text:
            value = text
        data.set_variable(spec.name, value, meta)
        self._emit(node.stream_id, "", spec.name, final=True)
        return value

    def _split_thinking(self, node: Node, data: StreamData, spec: Gen, text: str, cut_at: int | None) -> str:
        """Set the thinking variable; the answer after the span."""
        assert spec.reasoning_var is not None
        thinking, answer = split_thinking(text)
        self.thinking[node.id] = thinking
        data.set_variable(spec.reasoning_var, thinking, {})
        if answer is None:
            why = f"the output was cut at max_tokens={cut_at}" if cut_at is not None else "the model never closed it"
            raise GenerationError(f"gen {spec.name!r}: the thinking span has no end ({why}); "
                                  "a reasoning_budget closes it in time")
        return answer

    async def _generate(self, stream_id: int, data: StreamData, spec: Gen) -> tuple[GenChunk, str]:
        """Run one generation; append it to ``data``. Returns the final chunk and the text
        the generation added (the chunk's text less a healed token's own text)."""
        heal = healing_plan(data, spec, self.backend) if spec.token_healing else None
        ids, params, skip = (list(data.ids), spec.params, 0) if heal is None else heal
        params = dataclasses.replace(params, run_id=self.run_id)
        if params.reasoning_end is not None and not self.backend.supports_reasoning and (
                params.constraint is not None or params.reasoning_budget is not None):
            raise GenerationError(f"gen {spec.name!r}: a constraint or budget after a thinking span needs a "
                                  f"backend that starts it there (the in-process engine), not "
                                  f"{type(self.backend).__name__}")
        final: GenChunk | None = None
        num_chars = 0
        async for chunk in self.backend.generate(ids, params):
            # NOTE: a healed generation first re-produces the healed token's text, which
            # the listener has seen already: emit only what lies beyond its ``skip`` chars.
            self._emit(stream_id, chunk.delta_text[max(0, skip - num_chars):], spec.name)
            num_chars += len(chunk.delta_text)
            final = chunk
        if final is None or final.finish_reason is None:
            raise GenerationError("the backend ended a generation without a final output")
        if heal is None:
            data.append_generated(final.text, final.token_ids, self.backend)
            return final, final.text
        if not final.text.startswith(data.text[len(data.text) - skip:]):
            raise GenerationError(f"token healing: the output {final.text!r:.80} does not re-produce "
                                  f"the healed text {data.text[len(data.text) - skip:]!r}")
        data.replace_last_token(final.text, final.token_ids, self.backend)
        return final, final.text[skip:]

    async def _tool_call(self, node: Node) -> Any:
        spec: Gen = node.payload
        data = self.streams[node.stream_id]
        prompt_len = len(data.ids)
        final, text = await self._generate(node.stream_id, data, spec)
        meta = _gen_meta(final, prompt_len)
        self.recorder.generated(node, meta)
        started = time.perf_counter()
        call = await execute_call(text, spec.tools)
        self.recorder.tool_called(node, call.name, started, time.perf_counter(), call.error)
        observation = spec.tool_result_prefix + call.observation()
        data.append_text(observation, self.backend)
        self._emit(node.stream_id, observation)
        data.set_variable(spec.name, call, meta)
        self._emit(node.stream_id, "", spec.name, final=True)
        return call

    async def _select(self, node: Node) -> str:
        spec: Select = node.payload
        data = self.streams[node.stream_id]
        best, meta = await decide(self.backend, data.ids, spec, run_id=self.run_id)
        choice = spec.choices[best]
        data.append_text(choice, self.backend)
        self._emit(node.stream_id, choice, spec.name, final=True)
        data.set_variable(spec.name, choice, meta)
        return choice

    async def _var(self, node: Node) -> None:
        ref: Ref = node.payload
        value = ref.source.done.result()  # done: the source is a dependency
        if ref.key == REASONING_KEY:
            value = self.thinking[ref.source.id]
        text = value_text(value if ref.key in (None, REASONING_KEY) else value[ref.key])
        self.streams[node.stream_id].append_text(text, self.backend)
        self._emit(node.stream_id, text)

    async def _set(self, node: Node) -> Any:
        payload: SetPayload = node.payload
        self.streams[node.stream_id].set_variable(payload.name, payload.value, {"set": True})
        return payload.value

    async def _capture(self, node: Node) -> str | None:
        payload: CapturePayload = node.payload
        data = self.streams[node.stream_id]
        if payload.event == "begin":
            data.capture_starts[payload.name] = len(data.text)
            return None
        text = data.text[data.capture_starts.pop(payload.name):]
        data.set_variable(payload.name, text, {"captured": True})
        return text

    async def _fork(self, node: Node) -> None:
        payload: ForkPayload = node.payload
        parent = self.streams[node.stream_id]
        if len(payload.branch_ids) > 1 and parent.ids:
            await self.backend.cache_prefix(list(parent.ids), run_id=self.run_id)
        for branch_id in payload.branch_ids:
            self.streams[branch_id] = parent.branch()

    async def _join(self, node: Node) -> dict[str, list[Any]]:
        payload: JoinPayload = node.payload
        parent = self.streams[node.stream_id]
        branches = [self.streams[b] for b in payload.branch_ids]
        gathered: dict[str, list[Any]] = {}
        for name in dict.fromkeys(n for b in branches for n in b.own_variables):
            gathered[name] = [b.variables.get(name) for b in branches]
            meta = {"from_branches": list(payload.branch_ids),
                    "branches": [b.meta.get(name) for b in branches]}
            parent.set_variable(name, gathered[name], meta)
        if payload.mode == "concat":
            for branch in branches:
                added = branch.text[branch.fork_text_len:]
                parent.append_text(added, self.backend)
                self._emit(node.stream_id, added)
        return gathered


def _fail_if_pending(node: Node) -> None:
    # A task cancelled before it started never ran ``_run``; its node must still finish.
    if not node.done.done():
        node.done.set_exception(ProgramCancelledError(f"node {node.id} cancelled"))


def _gen_meta(final: GenChunk, prompt_len: int) -> dict[str, Any]:
    """``prompt_len``: the state's token count when the generation was sent."""
    meta: dict[str, Any] = {"finish_reason": final.finish_reason, "num_output_tokens": len(final.token_ids),
            "output_ids": list(final.token_ids),
            "num_cached_tokens": final.num_cached_tokens, "logprobs": final.logprobs,
            "num_tier_cached_tokens": final.num_tier_cached_tokens,
            "prompt_len": prompt_len, "constraint_check": final.constraint_check,
            "num_draft_tokens": final.num_draft_tokens, "num_accepted_tokens": final.num_accepted_tokens,
            "num_forced_tokens": final.num_forced_tokens}
    if final.top_logprobs is not None:
        meta["top_logprobs"] = final.top_logprobs
    if final.prompt_logprobs is not None:
        meta["prompt_logprobs"] = final.prompt_logprobs
    return meta
