"""``/v1/completions``: text or token prompts, ``n`` choices each, legacy logprobs."""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate
from typing import Any

from fastapi import Request

from runtime.errors import InvalidRequestError
from runtime.output.request_output import RequestOutput
from runtime.server.api.openai.endpoint import Endpoint, Job, output_constraint, token_text, usage
from runtime.server.api.openai.schema import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from runtime.server.engine_constraints import check_info
from runtime.server.serving import ServerContext, encode_prompt
from runtime.server.sse import EventStreamResponse
from runtime.server.tenants import Caller


class CompletionEndpoint(Endpoint):
    name = "completions"

    def __init__(self, ctx: ServerContext, body: CompletionRequest, caller: Caller) -> None:
        super().__init__(ctx, body, caller)
        self.req = body
        if (body.best_of or 1) > 1 or body.suffix:
            raise InvalidRequestError("best_of and suffix are not supported")
        if body.echo and body.stream:
            raise InvalidRequestError("echo is not supported with stream")
        self.prompts = self._prompt_ids(body.prompt)
        constraint = output_constraint(body, body.response_format)
        k = body.logprobs or 0
        self.jobs: list[Job] = [
            (ids, replace(self.params(len(ids), i * body.n + j, body.max_tokens, constraint,
                                      body.logprobs is not None, k),
                          prompt_logprobs=body.echo and body.logprobs is not None))
            for i, ids in enumerate(self.prompts) for j in range(body.n)]

    def _prompt_ids(self, prompt: Any) -> list[list[int]]:
        engine = self.ctx.engine
        if isinstance(prompt, str):
            return [encode_prompt(engine, prompt)]
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return [encode_prompt(engine, p) if isinstance(p, str) else list(p) for p in prompt]

    async def serve(self, request: Request) -> CompletionResponse | EventStreamResponse:
        if self.req.stream:
            return await self.stream(self.jobs)
        finals = await self.finals(request, self.jobs)
        choices = [CompletionChoice(index=i, text=self._echo(o) + o.text, finish_reason=o.finish_reason,
                                    logprobs=self._with_prompt(o, self._logprobs(o.token_ids, o)),
                                    constraint_check=check_info(o.constraint_check))
                   for i, o in enumerate(finals)]
        return CompletionResponse(id=self.id, model=self.model, choices=choices,
                                  usage=usage([len(p) for p in self.prompts], finals))

    def chunks(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        choice = CompletionChoice(index=index, text=out.delta_text, finish_reason=out.finish_reason,
                                  logprobs=self._logprobs(out.delta_token_ids, out),
                                  constraint_check=check_info(out.constraint_check))
        chunk = CompletionResponse(id=self.id, model=self.model, choices=[choice])
        return [chunk.model_dump(exclude_none=True)]

    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def usage_chunk(self, finals: list[RequestOutput]) -> dict[str, Any]:
        chunk = CompletionResponse(id=self.id, model=self.model, choices=[],
                                   usage=usage(self.prompt_lens(), finals))
        return chunk.model_dump(exclude_none=True)

    def _echo(self, out: RequestOutput) -> str:
        return self.ctx.engine.tokenizer.decode(out.prompt_token_ids) if self.req.echo else ""  # type: ignore[no-any-return]

    def _with_prompt(self, out: RequestOutput, lps: CompletionLogprobs | None) -> CompletionLogprobs | None:
        """With ``echo``: the prompt tokens' logprobs (the first has none) before the output's."""
        if not self.req.echo or lps is None:
            return lps
        ids = out.prompt_token_ids
        chosen = list(out.prompt_logprobs or [None] * len(ids))
        tokens = [self._token(t) for t in ids]
        offsets = list(accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []
        shift = len(self._echo(out))
        top = None if lps.top_logprobs is None else (
            [None if lp is None else {tok: lp} for tok, lp in zip(tokens, chosen, strict=True)] + lps.top_logprobs)
        return CompletionLogprobs(tokens=tokens + lps.tokens, token_logprobs=chosen + lps.token_logprobs,
                                  top_logprobs=top, text_offset=offsets + [o + shift for o in lps.text_offset])

    def _token(self, token_id: int) -> str:
        if self.req.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return token_text(self.ctx.engine.tokenizer, token_id)

    def _logprobs(self, token_ids: list[int], out: RequestOutput) -> CompletionLogprobs | None:
        """Legacy logprobs of ``token_ids`` (the last tokens of ``out``)."""
        if self.req.logprobs is None or out.logprobs is None:
            return None
        n = len(token_ids)
        lps = out.logprobs[len(out.token_ids) - n:] if n else []
        tokens = [self._token(t) for t in token_ids]
        offsets, pos = [], len(out.text) - len(out.delta_text) if n != len(out.token_ids) else 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        top: list[dict[str, float] | None] | None = None
        if self.req.logprobs and out.top_logprobs is not None:
            steps = out.top_logprobs[len(out.token_ids) - n:] if n else []
            top = [{self._token(i): lp for i, lp in step.items()} for step in steps]
        return CompletionLogprobs(tokens=tokens, token_logprobs=list[float | None](lps), top_logprobs=top,
                                  text_offset=offsets)
