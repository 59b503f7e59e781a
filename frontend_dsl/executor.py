"""Runs request-graph nodes on a backend.

Each submitted node becomes a task that waits for its dependencies and then runs, so every
node whose inputs are ready is in flight at once: sibling branches reach the backend
together and are batched there. A node whose dependency failed fails with the same
exception; other streams carry on. All methods run on the DSL loop thread
(``Session`` submits through ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from frontend_dsl.backend import Backend, GenChunk
from frontend_dsl.errors import GenerationError, ProgramCancelledError
from frontend_dsl.graph import Node
from frontend_dsl.output_constraint import parse_output
from frontend_dsl.primitives import Gen, Select
from frontend_dsl.stream_data import StreamData
from frontend_dsl.tokens import plan_append
from frontend_dsl.tools import execute_call

TextListener = Callable[[int, str], None]  # (stream_id, new text), called on the loop


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


class Executor:
    """Executes nodes of one program run against ``backend``."""

    def __init__(self, backend: Backend, on_text: TextListener | None = None) -> None:
        self.backend = backend
        self.streams: dict[int, StreamData] = {0: StreamData()}
        self._on_text = on_text
        self._tasks: set[asyncio.Task[None]] = set()
        self._handlers: dict[str, Callable[[Node], Awaitable[Any]]] = {
            "text": self._text, "gen": self._gen, "select": self._select,
            "fork": self._fork, "join": self._join, "tool_call": self._tool_call,
        }

    def submit(self, node: Node, deps: list[Node]) -> None:
        """Start ``node`` as soon as ``deps`` are done."""
        task = asyncio.ensure_future(self._run(node, deps))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: _fail_if_pending(node))

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
            result = await self._handlers[node.kind](node)
        except asyncio.CancelledError:
            node.done.set_exception(ProgramCancelledError(f"node {node.id} cancelled"))
        except Exception as exc:  # noqa: BLE001 - recorded on the node, surfaced to readers
            node.done.set_exception(exc)
        else:
            node.done.set_result(result)

    def _emit(self, stream_id: int, text: str) -> None:
        if self._on_text is not None and text:
            self._on_text(stream_id, text)

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
        final = await self._generate(node.stream_id, data, spec)
        cut_at = spec.params.max_tokens if final.finish_reason == "length" else None
        value = parse_output(final.text, spec.params.constraint, cut_at, final.constraint_check)
        data.set_variable(spec.name, value, _gen_meta(final, prompt_len))
        return value

    async def _generate(self, stream_id: int, data: StreamData, spec: Gen) -> GenChunk:
        final: GenChunk | None = None
        async for chunk in self.backend.generate(list(data.ids), spec.params):
            self._emit(stream_id, chunk.delta_text)
            final = chunk
        if final is None or final.finish_reason is None:
            raise GenerationError("the backend ended a generation without a final output")
        data.append_generated(final.text, final.token_ids, self.backend)
        return final

    async def _tool_call(self, node: Node) -> Any:
        spec: Gen = node.payload
        data = self.streams[node.stream_id]
        prompt_len = len(data.ids)
        final = await self._generate(node.stream_id, data, spec)
        call = await execute_call(final.text, spec.tools)
        observation = spec.tool_result_prefix + call.observation()
        data.append_text(observation, self.backend)
        self._emit(node.stream_id, observation)
        data.set_variable(spec.name, call, _gen_meta(final, prompt_len))
        return call

    async def _select(self, node: Node) -> str:
        spec: Select = node.payload
        data = self.streams[node.stream_id]
        scores, logprobs = await self._score_choices(data.ids, spec)
        best = max(range(len(spec.choices)), key=lambda i: (scores[i], -i))
        choice = spec.choices[best]
        data.append_text(choice, self.backend)
        self._emit(node.stream_id, choice)
        meta = {"scores": dict(zip(spec.choices, scores, strict=True)),
                "token_logprobs": dict(zip(spec.choices, logprobs, strict=True))}
        data.set_variable(spec.name, choice, meta)
        return choice

    async def _score_choices(
        self, ids: list[int], spec: Select
    ) -> tuple[list[float], list[list[float]]]:
        """Score every choice over the same span: from the earliest position any choice
        re-tokenizes (see ``tokens.py``), so a choice that merges with the state's last
        token is compared fairly with one that does not. Position 0 has no logprob."""
        plans = [plan_append(ids, c, self.backend) for c in spec.choices]
        start = max(1, min(keep for keep, _ in plans))
        full = [ids[:keep] + new for keep, new in plans]
        logprobs = list(await asyncio.gather(*(self.backend.score(f, start) for f in full)))
        if spec.method == "normalized":
            scores = [sum(lp) / max(1, len(lp)) for lp in logprobs]
        else:
            scores = [float(sum(lp)) for lp in logprobs]
        return scores, logprobs

    async def _fork(self, node: Node) -> None:
        payload: ForkPayload = node.payload
        parent = self.streams[node.stream_id]
        if len(payload.branch_ids) > 1 and parent.ids:
            await self.backend.cache_prefix(list(parent.ids))
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
    return {"finish_reason": final.finish_reason, "num_output_tokens": len(final.token_ids),
            "num_cached_tokens": final.num_cached_tokens, "logprobs": final.logprobs,
            "prompt_len": prompt_len, "constraint_check": final.constraint_check}
