"""From logits to the caller: drafts, verification, sampling, stop checks, detokenization.

The output processor owns the per-request state that is not about KV (a
``TrackedRequest`` in ``Request.output_state``: the detokenizer, callback, seed, grammar
matcher, logprobs, speculation counters) and is the only writer of a request's
``output_ids``, ``finish_reason`` and ``output_state``. It keeps no list of requests: the
scheduler's is the only one. In the engine step:

- before the pass, ``propose_drafts`` proposes speculative drafts (the scheduler decides
  which to keep);
- after it, ``sample`` turns logits into new tokens: verify items accept drafts exactly
  (``runtime.speculative.verify``), the others sample under their grammar masks, their
  penalties and ``min_tokens`` (``runtime.sampling.penalties``; the token counts the
  penalties need are kept here, updated as tokens are appended). Nothing
  reaches a request yet, so the scheduler can commit the KV first;
- ``emit`` appends each token (stop ids, stop strings, stop regexes, grammar end, length)
  and sends an incremental ``RequestOutput`` to the request's callback;
- ``finish`` ends a request for any reason (once) and keeps its final output, with a
  constrained output's ``constraint_check`` (``CheckedGrammar.check``), until the engine
  has released the request's pages: ``take_finals``, the scheduler's ``finish``, then
  ``send_finals``. Data flows one way: the processor never calls back into the engine.
"""

from __future__ import annotations

import logging

import torch

from runtime.constrained import CheckedGrammar, GrammarMatcher
from runtime.constrained.checked import CheckStats
from runtime.constrained.masking import mask_logits
from runtime.constrained.reasoning import ReasoningMatcher
from runtime.model.runner import ForwardOutput
from runtime.output.detokenizer import IncrementalDetokenizer
from runtime.output.request_output import (
    GRAMMAR_ERROR,
    ConstraintCheck,
    FinishReason,
    RequestOutput,
)
from runtime.output.state import (
    Final,
    NewTokens,
    OutputCallback,
    StepTokens,
    TopLogprobs,
    TrackedRequest,
)
from runtime.request import Request
from runtime.sampling.params import SamplingParams
from runtime.sampling.penalties import TokenHistory, apply_penalties, suppress_stop_ids
from runtime.sampling.sampler import sample
from runtime.scheduler.batch import ScheduledBatch
from runtime.scheduler.cost_model import StepCostModel
from runtime.speculative import (
    Candidate,
    DraftProposer,
    Proposal,
    Shadow,
    SpecStats,
    SpeculationGate,
    verify_drafts,
)

log = logging.getLogger("arbor.engine")


class OutputProcessor:
    """The engine's per-request output state and what turns logits into outputs.

    Args:
        generator: the engine's random generator: it draws the seed of every request
            submitted without one (so sampling is reproducible per engine seed).
        spec_fixed_cost_rows: a forward pass's fixed cost in rows, the speculation gate's
            prior until step costs are measured.
        cost_model: the engine's step cost model (the speculation gate reads it).
    """

    def __init__(self, tokenizer: object, eos_token_ids: list[int], max_model_len: int,
                 generator: torch.Generator,
                 spec_fixed_cost_rows: float, cost_model: StepCostModel | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._generator = generator
        self.gate = SpeculationGate(cost_model or StepCostModel(), spec_fixed_cost_rows)
        self._finals: list[Final] = []  # finished this step; sent once their pages are released
        self.proposer = DraftProposer(tokenizer)
        self.spec = SpecStats()  # speculation counters over all requests
        self.checks = CheckStats()  # final outputs checked against their whole constraint
        self.num_finished = 0

    # ---- registration (any thread) -------------------------------------------------------
    def register(self, request: Request, callback: OutputCallback | None) -> None:
        """Start tracking a new request (the engine refuses duplicate ids before this)."""
        params = request.params
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens, params.stop_regex)
        history = TokenHistory(request.prompt_ids) if params.penalized else None
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**63 - 1, (), generator=self._generator))
        request.output_state = TrackedRequest(request, detok, callback, seed, history=history)
        if params.reasoning is not None:  # a thinking span with no grammar after it (yet)
            self.attach_matcher(request, ReasoningMatcher(params.reasoning, None, self.eos_token_ids))

    def attach_matcher(self, request: Request, matcher: GrammarMatcher) -> None:
        """Constrain a tracked request (before it is scheduled); with a thinking span
        (``SamplingParams.reasoning``) the matcher starts where the span ends."""
        span = request.params.reasoning
        if span is not None and not isinstance(matcher, ReasoningMatcher):
            matcher = ReasoningMatcher(span, matcher, self.eos_token_ids)
        tracked(request).matcher = matcher

    def attach_grammar(self, request: Request, grammar: CheckedGrammar) -> None:
        """Constrain a tracked request by ``grammar``, which also checks its final output."""
        self.attach_matcher(request, grammar.new_matcher())
        tracked(request).grammar = grammar

    # ---- before the pass ------------------------------------------------------------------
    def propose_drafts(self, decoding: list[Request]) -> dict[str, list[int]]:
        """Draft tokens to verify, by request id: grammar-forced drafts always, lookup
        drafts where the gate expects them to pay (the rest become shadow rounds)."""
        # NOTE: drafts never change a token (greedy or sampled: see the sampler), so the
        # gate may choose freely for every request.
        lookup = self.gate.worth_proposing(len(decoding), self.proposer.max_draft_tokens)
        proposals: dict[str, Proposal] = {}
        by_id = {r.request_id: r for r in decoding}
        for req in decoding:
            if req.params.speculation and (p := self._propose(req, lookup)) is not None:
                proposals[req.request_id] = p
        candidates = [Candidate(rid, len(p.draft_ids),
                                None if p.forced else tracked(by_id[rid]).speculation.stats(p.source))
                      for rid, p in proposals.items()]
        chosen = self.gate.choose(len(decoding), candidates)
        drafts: dict[str, list[int]] = {}
        for rid, p in proposals.items():
            t = tracked(by_id[rid])
            if k := chosen.get(rid, 0):
                drafts[rid] = p.draft_ids[:k]
                t.draft_source = None if p.forced else p.source
                t.spec.forced_tokens += k if p.forced else 0
                self.spec.forced_tokens += k if p.forced else 0
            elif t.speculation.shadow is None:
                t.speculation.shadow = Shadow(p.source, tuple(p.draft_ids), len(t.request.output_ids))
        return drafts

    def _propose(self, req: Request, lookup: bool) -> Proposal | None:
        t = tracked(req)
        t.speculation.check_shadow(req.output_ids)
        room = min(req.params.max_new_tokens - len(req.output_ids), self.max_model_len - req.seq_len) - 1
        if room <= 0:
            return None
        lookup = lookup and t.speculation.may_propose()
        texts = None
        if lookup:
            if t.prompt_text is None:
                t.prompt_text = self.tokenizer.decode(req.prompt_ids)  # type: ignore[attr-defined]
            texts = (t.prompt_text, t.detok.text)
        return self.proposer.propose(req.all_ids, t.matcher, room, texts, lookup)

    # ---- after the pass: logits -> tokens --------------------------------------------------
    def sample(self, batch: ScheduledBatch, result: ForwardOutput) -> StepTokens:
        """New tokens of every request that produced some (verify items first)."""
        new = [self._verify(v.request, list(v.draft_ids), result.verify_logits[v.request.request_id])
               for v in batch.verify]
        by_id = {r.request_id: r for r in [*(i.request for i in batch.prefill), *batch.decode]}
        new += self._sample_rows(result, by_id)
        return StepTokens(new, [(by_id[rid], pairs) for rid, pairs in result.prompt_logprobs.items()])

    def _verify(self, req: Request, drafts: list[int], rows: torch.Tensor) -> NewTokens:
        """Accept drafts exactly (see runtime.speculative.verify)."""
        t = tracked(req)
        tokens, accepted = verify_drafts(rows, drafts, req.params, t.matcher, t.seed,
                                         len(req.output_ids), self._stop_ids(t), t.history)
        self._count_spec(t, len(drafts), accepted)
        logprobs, top = self._logprobs_of(req.params, rows[: len(tokens)], tokens)
        return NewTokens(req, tokens, logprobs, top, verified=True)

    def _sample_rows(self, result: ForwardOutput, by_id: dict[str, Request]) -> list[NewTokens]:
        if not result.sample_ids:
            return []
        reqs = [by_id[rid] for rid in result.sample_ids]
        states = [tracked(r) for r in reqs]
        dead = set(mask_logits(result.logits, [t.matcher for t in states]))
        self._adjust_logits(result.logits, states)
        out = sample(result.logits, [r.params for r in reqs], [t.seed for t in states],
                     [len(r.output_ids) for r in reqs])
        new = []
        for i, req in enumerate(reqs):
            k = req.params.top_logprobs
            chosen = [out.logprobs[i]] if out.logprobs is not None and req.params.logprobs else None
            top = [dict(list(out.top_logprobs[i].items())[:k])] if out.top_logprobs is not None and k else None
            ends = i in dead or req.params.max_new_tokens == 0
            new.append(NewTokens(req, [] if ends else [out.token_ids[i]], chosen, top, verified=False))
        return new

    def _adjust_logits(self, logits: torch.Tensor, tracked: list[TrackedRequest]) -> None:
        """Penalties and ``min_tokens`` on the sampled rows, in place."""
        if any(t.history is not None for t in tracked):
            apply_penalties(logits, [t.request.params for t in tracked], [t.history for t in tracked])
        short = [i for i, t in enumerate(tracked) if len(t.request.output_ids) < t.request.params.min_tokens]
        if short:
            suppress_stop_ids(logits, short, [sorted(self._stop_ids(tracked[i])) for i in short])

    def _stop_ids(self, t: TrackedRequest) -> set[int]:
        """The ids that end this request when sampled."""
        params = t.request.params
        ignore_eos = params.ignore_eos and t.matcher is None  # a grammar decides where EOS goes
        return set(params.stop_token_ids) | (set() if ignore_eos else set(self.eos_token_ids))

    def _count_spec(self, t: TrackedRequest, drafted: int, accepted: int) -> None:
        for stats in (t.spec, self.spec):
            stats.draft_tokens += drafted
            stats.accepted_tokens += accepted
            stats.verify_rounds += 1
        if t.draft_source is not None:
            t.speculation.record(t.draft_source, drafted, accepted)

    @staticmethod
    def _logprobs_of(
        params: SamplingParams, rows: torch.Tensor, tokens: list[int]
    ) -> tuple[list[float] | None, list[TopLogprobs] | None]:
        """(logprob of each token, top-k dicts) from verify rows, when asked for."""
        if not tokens or (not params.logprobs and not params.top_logprobs):
            return None, None
        logp = torch.log_softmax(rows.float(), dim=-1)
        picked = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
        top = None
        if params.top_logprobs:
            vals, idx = logp.topk(params.top_logprobs, dim=-1)
            top = [dict(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
        return (picked if params.logprobs else None), top

    # ---- after the commit: tokens -> callers ------------------------------------------------
    def emit(self, step: StepTokens) -> None:
        """Append the step's tokens and send each request's output."""
        self._record_prompt_logprobs(step.prompt_logprobs)
        for n in step.new:
            req, t = n.request, tracked(n.request)
            if req.params.max_new_tokens == 0:
                self.finish(req, "length")
            elif not n.token_ids:
                self.finish(req, "abort", error="the grammar admits no further token")
            else:
                self._append_all(req, t, n)

    def _append_all(self, req: Request, t: TrackedRequest, n: NewTokens) -> None:
        for j, token in enumerate(n.token_ids):
            if n.logprobs is not None:
                t.logprobs.append(n.logprobs[j])
            if n.top_logprobs is not None:
                t.top_logprobs.append(n.top_logprobs[j])
            # NOTE: after a verify pass the matcher already advanced past *all* tokens, so
            # its "terminated" state only speaks for the last one.
            self._append_token(req, t, token, matcher_advanced=n.verified, last=j == len(n.token_ids) - 1)
            if req.finish_reason is not None:
                return

    def _record_prompt_logprobs(self, found: list[tuple[Request, list[tuple[int, float]]]]) -> None:
        for req, pairs in found:
            t = tracked(req)
            if not t.prompt_logprobs:
                t.prompt_logprobs = [None] * len(t.request.prompt_ids)
            for pos, lp in pairs:
                t.prompt_logprobs[pos] = lp

    def _append_token(
        self, req: Request, t: TrackedRequest, token: int, matcher_advanced: bool = False, last: bool = True
    ) -> None:
        params = req.params
        if t.matcher is not None and not matcher_advanced and not t.matcher.accept_token(token):
            # NOTE: a grammar that hit its own resource bound refuses the token too; its
            # error says why (the client's constraint), where a bare refusal is ours.
            problem = t.matcher.error()
            self.finish(req, "abort", error=GRAMMAR_ERROR + problem if problem else f"token {token} rejected by the grammar")
            return
        if t.matcher is not None and (problem := t.matcher.error()):
            self.finish(req, "abort", error=GRAMMAR_ERROR + problem)
            return
        if token in self._stop_ids(t):
            del t.logprobs[len(req.output_ids):], t.top_logprobs[len(req.output_ids):]
            self.finish(req, "stop")
            return
        req.output_ids.append(token)
        if t.history is not None:
            t.history.add(token)
        t.detok.add(req.output_ids, check_stop=len(req.output_ids) >= params.min_tokens)
        if t.detok.stopped or (last and t.matcher is not None and t.matcher.is_terminated()):
            self.finish(req, "stop")
        elif len(req.output_ids) >= params.max_new_tokens or req.seq_len >= self.max_model_len:
            self.finish(req, "length")
        else:
            self._emit(t)

    # ---- the end -------------------------------------------------------------------------
    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """End ``req`` (idempotent); its final output waits in ``take_finals`` until the
        engine has released its pages."""
        if req.finish_reason is not None:
            return
        req.finish_reason = reason
        t = tracked(req)
        if reason != "stop" or not t.detok.stopped:
            t.detok.finish(req.output_ids)
        self.num_finished += 1
        self._finals.append(Final(req, error, self._check(t, reason)))

    def take_finals(self) -> list[Final]:
        """The requests finished since the last call, in finishing order."""
        finals, self._finals = self._finals, []
        return finals

    def send_finals(self, finals: list[Final]) -> None:
        """Send each finished request's final output (after the engine released it)."""
        for final in finals:
            self._emit(tracked(final.request), error=final.error, check=final.check)

    def _check(self, t: TrackedRequest, reason: FinishReason) -> ConstraintCheck | None:
        """The final output against its whole constraint (``CheckedGrammar.check``)."""
        if t.grammar is None or t.matcher is None or reason == "abort":
            return None
        # NOTE: a stop string or stop id cuts the text short of what the matcher consumed.
        grammar_end = (reason == "stop" and t.matcher.is_terminated() and not t.detok.stopped
                       and not t.request.params.stop_token_ids)
        check = t.grammar.check(self._answer_text(t), reason, grammar_end)
        self.checks.count(check)
        return check

    def _answer_text(self, t: TrackedRequest) -> str:
        """The text the constraint speaks for: after the thinking span, if any."""
        if not isinstance(t.matcher, ReasoningMatcher):
            return t.detok.text
        start = t.matcher.answer_start
        if start is None:
            return ""
        return str(self.tokenizer.decode(t.request.output_ids[start:],  # type: ignore[attr-defined]
                                         skip_special_tokens=t.request.params.skip_special_tokens))

    def _emit(self, t: TrackedRequest, error: str | None = None, check: ConstraintCheck | None = None) -> None:
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
            prompt_logprobs=(t.prompt_logprobs or [None] * len(req.prompt_ids)) if req.params.prompt_logprobs else None,
            num_cached_tokens=req.num_cached_tokens,
            num_tier_cached_tokens=req.num_tier_cached_tokens,
            num_draft_tokens=t.spec.draft_tokens,
            num_accepted_tokens=t.spec.accepted_tokens,
            num_forced_tokens=t.spec.forced_tokens,
            delta_text=delta,
            delta_token_ids=req.output_ids[t.emitted_tokens :],
            error=error,
            constraint_check=check,
        )
        t.emitted_tokens = len(req.output_ids)
        if t.callback is not None:
            try:
                t.callback(out)
            except Exception:  # a caller's callback must never take the engine down
                log.exception("output callback failed for %s", req.request_id)


def tracked(request: Request) -> TrackedRequest:
    """The output processor's state of a registered request."""
    state = request.output_state
    assert isinstance(state, TrackedRequest), f"request {request.request_id} was never registered"
    return state
