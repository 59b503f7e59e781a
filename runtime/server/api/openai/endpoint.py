"""What ``/v1/completions`` and ``/v1/chat/completions`` share: sampling parameters and
up-front checks, admission, the merge of ``n`` streams, SSE framing and usage."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from runtime.errors import InvalidRequestError
from runtime.output.request_output import RequestOutput
from runtime.sampling.params import SamplingParams
from runtime.sampling.reasoning import ReasoningSpan
from runtime.server import engine_constraints
from runtime.server.api.common.constraint_fields import CONSTRAINT_FIELDS, constraint_from_fields
from runtime.server.api.common.fields import check_fields
from runtime.server.api.openai import fields as openai_fields
from runtime.server.api.openai.schema import ResponseFormat, SamplingExtras, Usage
from runtime.server.errors import raise_if_failed, stream_error_event
from runtime.server.retention import retention_of
from runtime.server.serving import (
    EngineStream,
    ServerContext,
    StreamGroup,
    check_budget,
    collect,
    merge_streams,
    new_id,
    until_disconnect,
)
from runtime.server.sse import SSE_DONE, EventStreamResponse, sse
from runtime.server.tenants import Caller

Job = tuple[list[int], SamplingParams]


class Endpoint:
    """What completions and chat share: params, admission, streaming merge, usage."""

    name = "openai"

    def __init__(self, ctx: ServerContext, body: SamplingExtras, caller: Caller) -> None:
        self.ctx = ctx
        self.body = body
        self.caller = caller
        self.id = new_id("cmpl")
        ctx.check_model(body.model)
        self.model = body.model or ctx.model_name
        _refuse_unsupported(body)
        # headers for the answer (fields ignored on a --unknown-fields warn server)
        self.headers = check_fields(body, ctx.limits.unknown_fields, openai_fields.IGNORED,
                                    openai_fields.REFUSED)
        if body.n > ctx.limits.max_n:
            raise InvalidRequestError(f"n is {body.n}; this server allows at most {ctx.limits.max_n}")

    def params(self, prompt_len: int, index: int, max_tokens: int | None, constraint: Any,
               logprobs: bool, top_logprobs: int, reasoning: ReasoningSpan | None = None) -> SamplingParams:
        """The engine params of choice ``index``, after the up-front length checks
        (``reasoning``: the output's thinking span, where the constraint does not apply)."""
        b, limits, engine = self.body, self.ctx.limits, self.ctx.engine
        if max_tokens is None:  # as much as fits, up to the server default
            max_tokens = max(1, min(limits.default_max_tokens, engine.max_model_len - prompt_len))
        check_budget(engine, limits, prompt_len, max_tokens)
        stop = (b.stop,) if isinstance(b.stop, str) else tuple(b.stop or ())
        stop_regex = (b.stop_regex,) if isinstance(b.stop_regex, str) else tuple(b.stop_regex or ())
        return SamplingParams(
            max_new_tokens=max_tokens, temperature=b.temperature, top_p=b.top_p, top_k=b.top_k,
            min_p=b.min_p, seed=None if b.seed is None else b.seed + index, stop=stop,
            stop_token_ids=tuple(b.stop_token_ids or ()), ignore_eos=b.ignore_eos,
            stop_regex=stop_regex, min_tokens=b.min_tokens,
            frequency_penalty=b.frequency_penalty, presence_penalty=b.presence_penalty,
            repetition_penalty=b.repetition_penalty,
            logprobs=logprobs, top_logprobs=top_logprobs, constraint=constraint,
            ttft_slo=b.ttft_slo, itl_slo=b.itl_slo,
            retention=retention_of(b.retention, self.caller.tenant, engine.config), reasoning=reasoning)

    def group(self, jobs: list[Job]) -> StreamGroup:
        return StreamGroup(self.ctx, self.name, jobs, self.ctx.limits.deadline(self.body.timeout),
                           self.caller)

    async def finals(self, request: Request, jobs: list[Job]) -> list[RequestOutput]:
        """Run every job to completion (aborted if the client leaves)."""
        async with self.group(jobs) as streams:
            outs = await until_disconnect(request, asyncio.gather(*(collect(s) for s in streams)))
        for out in outs:
            raise_if_failed(self.ctx, out)
        self.ctx.metrics.requests.labels(self.name, "200").inc()
        return list(outs)

    async def stream(self, jobs: list[Job]) -> EventStreamResponse:
        group = self.group(jobs)
        streams = await group.open()  # 4xx / 429 / 503 before the first byte
        response = EventStreamResponse(self._events(streams), group.close)
        response.headers.update(self.headers)
        return response

    async def _events(self, streams: list[EngineStream]) -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        latest: dict[int, RequestOutput] = {}  # each choice's last output, for the usage so far
        options = self.body.stream_options
        continuous = options is not None and options.include_usage and options.continuous_usage_stats
        try:
            async for index, out in merge_streams(streams):
                raise_if_failed(self.ctx, out)
                latest[index] = out
                so_far = usage_so_far(self.prompt_lens(), list(latest.values())) if continuous else None
                for payload in self.chunks(index, out):
                    if so_far is not None:
                        payload["usage"] = so_far
                    yield sse(payload)
                if out.finished:
                    finals[index] = out
            if options is not None and options.include_usage:
                yield sse(self.usage_chunk([finals[i] for i in sorted(finals)]))
            self.ctx.metrics.requests.labels(self.name + "_stream", "200").inc()
        except Exception as exc:  # the status line is gone: report in-band
            yield sse(stream_error_event(exc, self.ctx))
        yield SSE_DONE

    def chunks(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        raise NotImplementedError

    def usage_chunk(self, finals: list[RequestOutput]) -> dict[str, Any]:
        raise NotImplementedError

    def prompt_lens(self) -> list[int]:
        """The token count of each prompt, in job order."""
        raise NotImplementedError


def _refuse_unsupported(b: SamplingExtras) -> None:
    if b.logit_bias:
        raise InvalidRequestError("logit_bias is not supported")



def usage(prompt_lens: list[int], finals: list[RequestOutput]) -> Usage:
    """Token counts; each prompt counts once however many choices (``finals`` in job
    order: the choices of prompt ``i`` are ``finals[i * n : (i + 1) * n]``)."""
    n = max(1, len(finals) // max(1, len(prompt_lens)))
    prompt = sum(prompt_lens)
    completion = sum(len(o.token_ids) for o in finals)
    cached = sum(max(o.num_cached_tokens for o in finals[i * n:(i + 1) * n]) for i in range(len(prompt_lens)))
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details={"cached_tokens": cached})


def usage_so_far(prompt_lens: list[int], outs: list[RequestOutput]) -> dict[str, int]:
    """``stream_options.continuous_usage_stats``' usage on a chunk: every prompt, and the
    tokens generated so far by every choice that has started."""
    prompt = sum(prompt_lens)
    completion = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def output_constraint(b: SamplingExtras, fmt: ResponseFormat | None) -> Any:
    """The constraint of a request: its ``response_format`` or one of the other servers'
    constraint fields (``api/common/constraint_fields.py``: ``regex``, ``guided_*``, ``ebnf``...);
    at most one."""
    given = {name: getattr(b, name) for name in CONSTRAINT_FIELDS}
    found = constraint_from_fields(given, b.json_bounds)
    if found is not None and fmt is not None and fmt.type != "text":
        raise InvalidRequestError(f"give at most one output constraint; got response_format, {found[0]}")
    return found[1] if found is not None else response_constraint(fmt, b.json_bounds)


def response_constraint(fmt: ResponseFormat | None, json_bounds: bool = True) -> Any:
    """The constraint of a ``response_format``; ``json_schema.strict`` refuses a schema the
    grammar could only relax (400 at submission)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return engine_constraints.json_schema({"type": "object"}, json_bounds=json_bounds)
    assert fmt.json_schema is not None
    return engine_constraints.json_schema(fmt.json_schema.schema_, strict=bool(fmt.json_schema.strict),
                                          json_bounds=json_bounds)


def token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id], skip_special_tokens=False))
