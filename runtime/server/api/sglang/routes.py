"""SGLang's native protocol, so the unmodified ``sglang`` frontend (``sgl.RuntimeEndpoint``)
runs its programs against Arbor:

    POST /generate                       one prompt or a batch (text or input_ids, ``n``
                                         samples each); Arbor's fields and SGLang's
    GET  /get_model_info, /model_info    model_path, served_model_name, is_generation...
    GET  /server_info, /get_server_info  the engine's settings and live counters
    GET|POST /flush_cache                evict the prefix cache's unlocked pages

``/generate`` answers one object per prompt (a list for a batch or ``n`` > 1) with
SGLang's ``text``, ``output_ids`` and ``meta_info`` (``id``, ``finish_reason`` as
``{"type": ...}``, token counts, logprobs as ``[logprob, token_id, text]`` triples) and
Arbor's ``finish_reason`` text and ``meta``. Streamed, every event carries the text and
ids so far plus ``meta_info`` (SGLang's shape) and Arbor's ``delta_text`` /
``delta_token_ids``; a batch's events carry their prompt's ``index``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from runtime.errors import InvalidRequestError
from runtime.output.request_output import RequestOutput
from runtime.sampling.params import SamplingParams
from runtime.server import engine_constraints
from runtime.server.api.common.constraint_fields import constraint_from_fields
from runtime.server.api.common.fields import check_fields
from runtime.server.api.sglang import schema
from runtime.server.errors import raise_if_failed, stream_error_event
from runtime.server.retention import retention_of
from runtime.server.serving import (
    EngineStream,
    ServerContext,
    StreamGroup,
    check_budget,
    collect,
    encode_prompt,
    merge_streams,
    until_disconnect,
)
from runtime.server.sse import SSE_DONE, EventStreamResponse, sse
from runtime.server.tenants import Caller, caller_of


@dataclasses.dataclass(frozen=True)
class Job:
    """One engine request of a ``/generate`` and what its answer must report."""

    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool  # SGLang's meta_info logprob fields
    input_start: int | None  # first prompt position of input_token_logprobs; None: none
    top_logprobs_num: int
    rid: str | None  # the client's id, echoed as meta_info.id


class GeneratePlan:
    """A ``/generate`` request translated into engine requests (SGLang's order: for ``n``
    samples of a batch, sample ``j`` of prompt ``i`` is answer ``j * batch + i``)."""

    def __init__(self, ctx: ServerContext, body: schema.SglGenerateRequest, caller: Caller) -> None:
        self.ctx = ctx
        self.body = body
        self.caller = caller
        self.headers = _check_fields(body, ctx.limits.unknown_fields)
        prompts = self._prompts()
        sps = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params]
        if len(sps) == 1:
            sps = sps * len(prompts)
        if len(sps) != len(prompts):
            raise InvalidRequestError(f"{len(sps)} sampling_params for {len(prompts)} prompts")
        for name in ("return_logprob", "logprob_start_len", "top_logprobs_num", "rid"):
            value = getattr(body, name)
            if isinstance(value, list) and len(value) != len(prompts):
                raise InvalidRequestError(f"{name} has {len(value)} values for {len(prompts)} prompts")
        n = sps[0].n
        if any(sp.n != n for sp in sps):
            raise InvalidRequestError("every prompt of a batch needs the same n")
        if n > ctx.limits.max_n:
            raise InvalidRequestError(f"n is {n}; this server allows at most {ctx.limits.max_n}")
        self.batched = isinstance(body.text, list) or _is_batch(body.input_ids) or n > 1
        self.jobs = [self._job(i, ids, sps[i], j) for j in range(n) for i, ids in enumerate(prompts)]

    def _prompts(self) -> list[list[int]]:
        engine, body = self.ctx.engine, self.body
        if isinstance(body.text, str):
            return [encode_prompt(engine, body.text)]
        if isinstance(body.text, list):
            if not body.text:
                raise InvalidRequestError("the batch of prompts is empty")
            return [encode_prompt(engine, t) for t in body.text]
        ids = body.input_ids or []
        if _is_batch(ids):
            return [list(p) for p in ids]  # type: ignore[arg-type]
        return [list(ids)]  # type: ignore[arg-type]

    def _job(self, i: int, ids: list[int], sp: schema.SglSamplingParams, sample: int) -> Job:
        engine, limits = self.ctx.engine, self.ctx.limits
        return_logprob = bool(_at(self.body.return_logprob, i))
        start = int(_at(self.body.logprob_start_len, i))
        top = int(_at(self.body.top_logprobs_num, i))
        if start < -1 or top < 0:
            raise InvalidRequestError("logprob_start_len must be >= -1 and top_logprobs_num >= 0")
        input_start = start if return_logprob and 0 <= start < len(ids) else None
        if input_start is not None and top > 0:
            raise InvalidRequestError("top_logprobs_num with prompt positions (logprob_start_len) is not "
                                      "supported: this server computes no top logprobs of prompt tokens; "
                                      "give logprob_start_len=-1 or top_logprobs_num=0")
        max_new = sp.max_new_tokens
        if max_new is None:  # SGLang: as many as fit
            max_new = max(0, min(limits.max_tokens, engine.max_model_len - len(ids)))
        check_budget(engine, limits, len(ids), max_new)
        # NOTE: SGLang's first prompt position has no logprob (None); Arbor scores from the next
        first_scored = None if input_start is None or input_start + 1 >= len(ids) else input_start + 1
        prompt_logprobs = sp.prompt_logprobs or first_scored is not None
        lp_start = min(sp.logprob_start_len if sp.prompt_logprobs else len(ids),
                       first_scored if first_scored is not None else len(ids)) if prompt_logprobs else 0
        seed = sp.seed if sp.seed is not None else sp.sampling_seed
        params = SamplingParams(
            max_new_tokens=max_new, temperature=sp.temperature, top_p=sp.top_p,
            top_k=0 if sp.top_k == -1 else sp.top_k, min_p=sp.min_p,
            seed=None if seed is None else seed + sample, stop=_strings(sp.stop),
            stop_token_ids=tuple(sp.stop_token_ids), stop_regex=_strings(sp.stop_regex),
            ignore_eos=sp.ignore_eos, min_tokens=max(sp.min_tokens, sp.min_new_tokens),
            frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
            repetition_penalty=sp.repetition_penalty, logprobs=sp.logprobs or return_logprob,
            top_logprobs=max(sp.top_logprobs, top if return_logprob else 0),
            prompt_logprobs=prompt_logprobs, logprob_start_len=lp_start,
            skip_special_tokens=sp.skip_special_tokens, speculation=sp.speculation,
            ttft_slo=sp.ttft_slo, itl_slo=sp.itl_slo, constraint=_constraint(sp),
            retention=retention_of(self.body.retention, self.caller.tenant, engine.config))
        rid = _at(self.body.rid, i) if self.body.rid is not None else None
        return Job(ids, params, return_logprob, input_start, top if return_logprob else 0, rid)

    # ---- answers ------------------------------------------------------------------------------

    def answer(self, k: int, out: RequestOutput, stream: EngineStream) -> dict[str, Any]:
        """The whole answer of engine request ``k`` (non-streamed)."""
        return {"text": out.text, "output_ids": out.token_ids, "meta_info": self.meta_info(k, out, stream),
                "finish_reason": str(out.finish_reason), "meta": _meta(out, stream).model_dump()}

    def chunk(self, k: int, out: RequestOutput, stream: EngineStream) -> dict[str, Any]:
        """One stream event of engine request ``k``: SGLang's (text so far) and Arbor's (deltas)."""
        event: dict[str, Any] = {"text": out.text, "output_ids": out.token_ids,
                                 "meta_info": self.meta_info(k, out, stream),
                                 "delta_text": out.delta_text, "delta_token_ids": out.delta_token_ids}
        if self.batched:
            event["index"] = k
        if out.finished:
            event["finish_reason"] = str(out.finish_reason)
            event["meta"] = _meta(out, stream).model_dump(exclude_none=True)
        return event

    def meta_info(self, k: int, out: RequestOutput, stream: EngineStream) -> dict[str, Any]:
        job = self.jobs[k]
        info: dict[str, Any] = {
            "id": job.rid or out.request_id, "finish_reason": _finish_reason(out),
            "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
            "cached_tokens": out.num_cached_tokens, "cached_tokens_details": _cached_details(out).model_dump(),
            "e2e_latency": time.monotonic() - stream.started}
        if job.return_logprob:
            info.update(self._logprobs(job, out))
        return info

    def _logprobs(self, job: Job, out: RequestOutput) -> dict[str, Any]:
        tokenizer = self.ctx.engine.tokenizer
        with_text = self.body.return_text_in_logprobs

        def triple(logprob: float | None, token_id: int) -> list[Any]:
            text = str(tokenizer.decode([token_id], skip_special_tokens=False)) if with_text else None
            return [logprob, token_id, text]

        prompt, scored = out.prompt_token_ids, out.prompt_logprobs or []
        inputs = [] if job.input_start is None else [
            triple(None if pos == job.input_start else scored[pos], prompt[pos])
            for pos in range(job.input_start, len(prompt))]
        outputs = [triple(lp, t) for lp, t in zip(out.logprobs or [], out.token_ids, strict=False)]
        info: dict[str, Any] = {"input_token_logprobs": inputs, "output_token_logprobs": outputs}
        if job.top_logprobs_num:
            info["input_top_logprobs"] = []  # NOTE: only without prompt positions (refused otherwise)
            info["output_top_logprobs"] = [
                [triple(lp, t) for t, lp in sorted(step.items(), key=lambda kv: -kv[1])][:job.top_logprobs_num]
                for step in out.top_logprobs or []]
        return info


def build_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    engine = ctx.engine

    @router.post("/generate", response_model=None)
    async def generate(body: schema.SglGenerateRequest, request: Request) -> JSONResponse | EventStreamResponse:
        caller = caller_of(request.headers, cache_salt=body.cache_salt)
        plan = GeneratePlan(ctx, body, caller)
        group = StreamGroup(ctx, "generate", [(j.input_ids, j.params) for j in plan.jobs],
                            ctx.limits.deadline(body.timeout), caller)
        if body.stream:
            streams = await group.open()  # 4xx/429/503 before the first byte
            response = EventStreamResponse(_events(ctx, plan, streams), group.close)
            response.headers.update(plan.headers)
            return response
        async with group as streams:
            outs = await until_disconnect(request, asyncio.gather(*(collect(s) for s in streams)))
        for out in outs:
            raise_if_failed(ctx, out)
        ctx.metrics.requests.labels("generate", "200").inc()
        answers = [plan.answer(k, out, streams[k]) for k, out in enumerate(outs)]
        return JSONResponse(answers if plan.batched else answers[0], headers=plan.headers)

    @router.get("/get_model_info")
    @router.get("/model_info")
    async def model_info() -> dict[str, Any]:
        cfg = engine.config
        return {"model_path": cfg.model, "served_model_name": ctx.model_name, "tokenizer_path": cfg.model,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": cfg.version(), "max_model_len": engine.max_model_len}

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        settings = {k: v for k, v in dataclasses.asdict(engine.config).items()
                    if isinstance(v, str | int | float | bool | type(None))}
        return {**settings, "served_model_name": ctx.model_name, "context_length": engine.max_model_len,
                "internal_states": [engine.metrics()], "version": _version(), "frontend": "arbor"}

    @router.post("/flush_cache", operation_id="flush_cache")
    @router.get("/flush_cache", operation_id="flush_cache_get")
    async def flush_cache() -> PlainTextResponse:
        freed = await asyncio.to_thread(engine.flush_cache)
        return PlainTextResponse(f"Cache flushed.\n{freed} pages freed (pages of running requests stay).\n")

    return router


async def _events(ctx: ServerContext, plan: GeneratePlan, streams: list[EngineStream]) -> AsyncIterator[str]:
    """SSE body of a streamed ``/generate``; the response's ``on_close`` aborts leftovers."""
    try:
        async for k, out in merge_streams(streams):
            raise_if_failed(ctx, out)
            yield sse(plan.chunk(k, out, streams[k]))
        ctx.metrics.requests.labels("generate_stream", "200").inc()
    except Exception as exc:  # the status line is gone: report in-band
        yield sse(stream_error_event(exc, ctx))
    yield SSE_DONE


def _check_fields(body: schema.SglGenerateRequest, policy: str) -> dict[str, str]:
    sps = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params]
    for sp in sps:  # refused sampling fields first (unknown ones are reported below, by path)
        check_fields(sp, "warn", schema.SAMPLING_IGNORED, schema.SAMPLING_REFUSED)
    names = [*schema.SAMPLING_IGNORED, *schema.SAMPLING_REFUSED]
    ignored = {f"sampling_params.{p}{name}": "" for name in names for p in ("", "*.")}
    return check_fields(body, policy, ignored, schema.REFUSED)


def _constraint(sp: schema.SglSamplingParams) -> Any:
    """Arbor's ``constraint`` object or SGLang's ``regex`` / ``json_schema`` / ``ebnf``: at most one."""
    found = constraint_from_fields({"regex": sp.regex, "json_schema": sp.json_schema, "ebnf": sp.ebnf},
                                   sp.json_bounds)
    if sp.constraint is not None:
        if found is not None:
            raise InvalidRequestError(f"give at most one output constraint; got constraint, {found[0]}")
        return engine_constraints.from_spec(sp.constraint)
    return found[1] if found is not None else None


def _finish_reason(out: RequestOutput) -> dict[str, Any] | None:
    """SGLang's ``{"type": ...}`` (``matched`` is null: the engine does not report which
    stop string or token ended the output)."""
    if out.finish_reason is None:
        return None
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.token_ids)}
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": None}
    return {"type": "abort", "message": out.error or "aborted"}


def _cached_details(out: RequestOutput) -> schema.CachedTokensDetails:
    return schema.CachedTokensDetails(pool=out.num_cached_tokens - out.num_tier_cached_tokens,
                               tier=out.num_tier_cached_tokens)


def _meta(out: RequestOutput, stream: EngineStream) -> schema.GenerateMeta:
    top = None
    if out.top_logprobs is not None:
        top = [{str(k): v for k, v in step.items()} for step in out.top_logprobs]
    return schema.GenerateMeta(request_id=out.request_id, prompt_tokens=len(out.prompt_token_ids),
                        completion_tokens=len(out.token_ids), cached_tokens=out.num_cached_tokens,
                        cached_tokens_details=_cached_details(out),
                        e2e_latency=time.monotonic() - stream.started, logprobs=out.logprobs,
                        top_logprobs=top, prompt_logprobs=out.prompt_logprobs,
                        constraint_check=engine_constraints.check_info(out.constraint_check))


def _at(value: Any, i: int) -> Any:
    """A per-prompt field: one value for all, or a list with one per prompt (checked)."""
    return value[i] if isinstance(value, list) else value


def _is_batch(ids: Any) -> bool:
    return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


def _strings(value: str | list[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("arbor")
    except PackageNotFoundError:
        return "unknown"
