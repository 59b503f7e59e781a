"""From logits to the caller: drafts, verification, sampling, stop checks, detokenization.

The engine's step runs the model; everything per request around that pass lives here,
on the engine thread, inside the step:

- before the pass, ``propose_drafts`` gives decoding requests speculative drafts;
- after it, ``verify_and_emit`` accepts drafts exactly and ``sample_and_emit`` samples
  (grammar masks first); each token goes through ``_append_token``: stop ids, stop
  strings, length, then an incremental ``RequestOutput`` to the request's callback;
- ``finish`` ends a request for any reason: ``release`` (given by the engine) takes it
  out of the scheduler, then the final output goes out. A request is finished once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.detokenizer import IncrementalDetokenizer
from runtime.grammar_step import mask_logits
from runtime.outputs import FinishReason, RequestOutput
from runtime.request import Request
from runtime.sampler import sample
from runtime.sampling_params import SamplingParams
from runtime.scheduler.scheduler import Scheduler
from runtime.speculative import DraftProposer, SpecStats, lookup_break_even, verify_drafts

log = logging.getLogger("arbor.engine")
OutputCallback = Callable[[RequestOutput], None]



@dataclass(eq=False)
class TrackedRequest:
    """Engine-side companions of a request: its detokenizer, callback, generator."""

    request: Request
    detok: IncrementalDetokenizer
    callback: OutputCallback | None
    generator: torch.Generator | None
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    emitted_tokens: int = 0
    matcher: Any = None  # runtime.constrained GrammarMatcher when constrained
    spec: SpecStats = field(default_factory=SpecStats)
    drafts_from_lookup: bool = False  # this step's drafts came from prompt lookup
    prompt_text: str | None = None  # decoded once, for text-level prompt lookup


class OutputProcessor:
    """The engine's per-request state (``tracked``) and what turns logits into outputs.

    Args:
        release: takes a finishing request out of the scheduler (or wherever the engine
            holds it); called once per request, before its final output is emitted.
        generator: the engine's random generator, for requests without a seed.
        spec_fixed_cost_rows: a forward pass's fixed cost in rows, for drafting decisions.
    """

    def __init__(self, tokenizer: Any, scheduler: Scheduler, eos_token_ids: list[int],
                 max_model_len: int, generator: torch.Generator,
                 release: Callable[[Request, FinishReason], None], spec_fixed_cost_rows: float) -> None:
        self.tokenizer = tokenizer
        self._scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._generator = generator
        self._release = release
        self._spec_fixed_cost_rows = spec_fixed_cost_rows
        self.tracked: dict[str, TrackedRequest] = {}
        self.proposer = DraftProposer(tokenizer)
        self.spec = SpecStats()  # speculation counters over all requests
        self.num_finished = 0

    def track(self, request: Request, callback: OutputCallback | None) -> TrackedRequest:
        """The engine-side state of a new request (not yet registered in ``tracked``)."""
        params = request.params
        return TrackedRequest(
            request,
            IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens),
            callback,
            torch.Generator().manual_seed(params.seed) if params.seed is not None else None,
            [], [],
        )

    def propose_drafts(self, decoding: list[Request]) -> None:
        """Draft tokens for every decoding request that allows speculation."""
        batch_even = lookup_break_even(len(decoding), self._spec_fixed_cost_rows)
        alone_even = lookup_break_even(1, self._spec_fixed_cost_rows)
        for req in decoding:
            if not req.params.speculation:
                continue
            t = self.tracked[req.request_id]
            room = min(req.params.max_new_tokens - len(req.output_ids), self.max_model_len - req.seq_len) - 1
            if room <= 0:
                continue
            if t.prompt_text is None:
                t.prompt_text = self.tokenizer.decode(req.prompt_ids)
            texts = (t.prompt_text, t.detok.text)
            # NOTE: only greedy requests follow the batch size: a sampled request's random
            # draws depend on whether it drafted, and a seeded request must give the same
            # tokens alone and inside any batch, so it is judged as if alone.
            gate = batch_even if req.params.greedy else alone_even
            drafts, forced = self.proposer.propose(req.all_ids, t.matcher, t.spec, room, texts, gate)
            req.draft_ids = drafts
            t.drafts_from_lookup = bool(drafts) and not forced
            if t.drafts_from_lookup:
                t.spec.lookup_rounds += 1
                t.spec.lookup_draft_tokens += len(drafts)
            t.spec.forced_tokens += forced
            self.spec.forced_tokens += forced

    def verify_and_emit(self, reqs: list[Request], logits: dict[str, torch.Tensor]) -> None:
        """Accept drafts exactly (see runtime.speculative.verify), then emit the tokens."""
        for req in reqs:
            t = self.tracked[req.request_id]
            drafts = req.draft_ids
            rows = logits[req.request_id]
            stop_ids = set(req.params.stop_token_ids) | set(self.eos_token_ids)
            tokens, accepted = verify_drafts(rows, drafts, req.params, t.matcher,
                                             t.generator or self._generator, stop_ids)
            self._scheduler.commit_verify(req, len(tokens))
            self._count_spec(t, len(drafts), accepted, from_lookup=t.drafts_from_lookup)
            if not tokens:
                self.finish(req, "abort", error="the grammar admits no further token")
                continue
            logprobs = self._logprobs_of(req.params, rows[: len(tokens)], tokens)
            for j, token in enumerate(tokens):
                if logprobs is not None:
                    chosen, top = logprobs
                    if req.params.logprobs:
                        t.logprobs.append(chosen[j])
                    if top is not None:
                        t.top_logprobs.append(top[j])
                # NOTE: the matcher already advanced past *all* tokens, so its
                # "terminated" state only speaks for the last one.
                self._append_token(req, t, token, matcher_advanced=True, last=j == len(tokens) - 1)
                if req.finish_reason is not None:
                    break

    def _count_spec(self, t: TrackedRequest, drafted: int, accepted: int, from_lookup: bool) -> None:
        for stats in (t.spec, self.spec):
            stats.draft_tokens += drafted
            stats.accepted_tokens += accepted
            stats.verify_rounds += 1
        if from_lookup:
            t.spec.lookup_accepted_tokens += accepted

    @staticmethod
    def _logprobs_of(
        params: SamplingParams, rows: torch.Tensor, tokens: list[int]
    ) -> tuple[list[float], list[dict[int, float]] | None] | None:
        """(logprob of each token, top-k dicts) from verify rows, when asked for."""
        if not params.logprobs and not params.top_logprobs:
            return None
        logp = torch.log_softmax(rows.float(), dim=-1)
        picked = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
        top = None
        if params.top_logprobs:
            vals, idx = logp.topk(params.top_logprobs, dim=-1)
            top = [dict(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
        return picked, top

    def record_prompt_logprobs(self, found: dict[str, list[tuple[int, float]]]) -> None:
        for rid, pairs in found.items():
            req = self.tracked[rid].request
            if not req.prompt_logprobs:
                req.prompt_logprobs = [None] * len(req.prompt_ids)
            for pos, lp in pairs:
                req.prompt_logprobs[pos] = lp

    def sample_and_emit(self, result: Any) -> None:
        reqs: list[Request] = result.sample_requests
        if not reqs:
            return
        tracked = [self.tracked[r.request_id] for r in reqs]
        dead = set(mask_logits(result.logits, [t.matcher for t in tracked]))
        out = sample(result.logits, [r.params for r in reqs], [t.generator for t in tracked], self._generator)
        for i, (req, t) in enumerate(zip(reqs, tracked, strict=True)):
            if req.params.max_new_tokens == 0:
                self.finish(req, "length")
                continue
            if i in dead:
                self.finish(req, "abort", error="the grammar admits no further token")
                continue
            token = out.token_ids[i]
            if out.logprobs is not None and req.params.logprobs:
                t.logprobs.append(out.logprobs[i])
            if out.top_logprobs is not None and req.params.top_logprobs:
                top = out.top_logprobs[i]
                t.top_logprobs.append(dict(list(top.items())[: req.params.top_logprobs]))
            self._append_token(req, t, token)

    def _append_token(
        self, req: Request, t: TrackedRequest, token: int, matcher_advanced: bool = False, last: bool = True
    ) -> None:
        params = req.params
        if t.matcher is not None and not matcher_advanced and not t.matcher.accept_token(token):
            self.finish(req, "abort", error=f"token {token} rejected by the grammar")
            return
        if t.matcher is not None and (problem := t.matcher.error()):
            self.finish(req, "abort", error=f"grammar error: {problem}")
            return
        ignore_eos = params.ignore_eos and t.matcher is None  # a grammar decides where EOS goes
        if token in params.stop_token_ids or (token in self.eos_token_ids and not ignore_eos):
            if t.logprobs and len(t.logprobs) > len(req.output_ids):
                t.logprobs.pop()
            if t.top_logprobs and len(t.top_logprobs) > len(req.output_ids):
                t.top_logprobs.pop()
            self.finish(req, "stop")
            return
        req.output_ids.append(token)
        t.detok.add(req.output_ids)
        if t.detok.stopped or (last and t.matcher is not None and t.matcher.is_terminated()):
            self.finish(req, "stop")
        elif len(req.output_ids) >= params.max_new_tokens or req.seq_len >= self.max_model_len:
            self.finish(req, "length")
        else:
            self._emit(t)

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        if req.finish_reason is not None:
            return
        self._release(req, reason)
        t = self.tracked.pop(req.request_id)
        if reason != "stop" or not t.detok.stopped:
            t.detok.finish(req.output_ids)
        self.num_finished += 1
        self._emit(t, error=error)

    def _emit(self, t: TrackedRequest, error: str | None = None) -> None:
        req = t.request
        final = req.finish_reason is not None
        delta = t.detok.take(final)
        out = RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_ids,
            token_ids=list(req.output_ids),
            text=t.detok.text[: t.detok.emitted],
            finish_reason=req.finish_reason,
            logprobs=list(t.logprobs) if req.params.logprobs else None,
            top_logprobs=list(t.top_logprobs) if req.params.top_logprobs else None,
            prompt_logprobs=(req.prompt_logprobs or [None] * len(req.prompt_ids)) if req.params.prompt_logprobs else None,
            num_cached_tokens=req.num_cached_tokens,
            delta_text=delta,
            delta_token_ids=req.output_ids[t.emitted_tokens :],
            error=error,
        )
        t.emitted_tokens = len(req.output_ids)
        if t.callback is not None:
            try:
                t.callback(out)
            except Exception:  # a caller's callback must never take the engine down
                log.exception("output callback failed for %s", req.request_id)

