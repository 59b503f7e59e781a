"""From logits to the caller: drafts, verification, sampling, stop checks, detokenization.

The output processor owns the per-request state that is not about KV (``tracked``: the
detokenizer, callback, seed, grammar matcher, logprobs, speculation counters) and is
the only writer of a request's ``output_ids`` and ``finish_reason``. In the engine step:

- before the pass, ``propose_drafts`` proposes speculative drafts (the scheduler decides
  which to keep);
- after it, ``sample`` turns logits into new tokens: verify items accept drafts exactly
  (``runtime.speculative.verify``), the others sample under their grammar masks, their
  penalties and ``min_tokens`` (``runtime.sampling.penalties``; the token counts the
  penalties need are kept here, updated as tokens are appended). Nothing
  reaches a request yet, so the scheduler can commit the KV first;
- ``emit`` appends each token (stop ids, stop strings, stop regexes, grammar end, length)
  and sends an incremental ``RequestOutput`` to the request's callback;
- ``finish`` ends a request for any reason: ``release`` (given by the engine) takes it
  out of the scheduler, then the final output goes out, with a constrained output's
  ``constraint_check`` (``CheckedGrammar.check``). A request is finished once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from runtime.constrained import CheckedGrammar, GrammarMatcher
from runtime.constrained.checked import CheckStats
from runtime.constrained.masking import mask_logits
from runtime.errors import InvalidRequestError
from runtime.model.runner import ForwardOutput
from runtime.output.detokenizer import IncrementalDetokenizer
from runtime.output.state import NewTokens, OutputCallback, StepTokens, TopLogprobs, TrackedRequest
from runtime.outputs import GRAMMAR_ERROR, ConstraintCheck, FinishReason, RequestOutput
from runtime.request import Request
from runtime.sampling.penalties import TokenHistory, apply_penalties, suppress_stop_ids
from runtime.sampling.sampler import sample
from runtime.sampling_params import SamplingParams
from runtime.scheduler.batch import ScheduledBatch
from runtime.speculative import DraftProposer, SpecStats, lookup_break_even, verify_drafts

log = logging.getLogger("arbor.engine")


class OutputProcessor:
    """The engine's per-request output state and what turns logits into outputs.

    Args:
        release: takes a finishing request out of the scheduler (or wherever the engine
            holds it); called once per request, before its final output is emitted.
        generator: the engine's random generator: it draws the seed of every request
            submitted without one (so sampling is reproducible per engine seed).
        spec_fixed_cost_rows: a forward pass's fixed cost in rows, for drafting decisions.
    """

    def __init__(self, tokenizer: object, eos_token_ids: list[int], max_model_len: int,
                 generator: torch.Generator, release: Callable[[Request, FinishReason], None],
                 spec_fixed_cost_rows: float) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._generator = generator
        self._release = release
        self._spec_fixed_cost_rows = spec_fixed_cost_rows
        self._tracked: dict[str, TrackedRequest] = {}
        self._lock = threading.Lock()  # registration races with finishing on the engine thread
        self.proposer = DraftProposer(tokenizer)
        self.spec = SpecStats()  # speculation counters over all requests
        self.checks = CheckStats()  # final outputs checked against their whole constraint
        self.num_finished = 0

    # ---- registration (any thread) -------------------------------------------------------
    def register(self, request: Request, callback: OutputCallback | None) -> None:
        """Start tracking a new request.

        Raises:
            InvalidRequestError: a request with the same id is in flight.
        """
        params = request.params
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens, params.stop_regex)
        history = TokenHistory(request.prompt_ids) if params.penalized else None
        with self._lock:
            if request.request_id in self._tracked:
                raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
            seed = params.seed if params.seed is not None else int(
                torch.randint(0, 2**63 - 1, (), generator=self._generator))
            self._tracked[request.request_id] = TrackedRequest(request, detok, callback, seed, history=history)

    def attach_matcher(self, request_id: str, matcher: GrammarMatcher) -> None:
        """Constrain a tracked request (before it is scheduled)."""
        self._tracked[request_id].matcher = matcher

    def attach_grammar(self, request_id: str, grammar: CheckedGrammar) -> None:
        """Constrain a tracked request by ``grammar``, which also checks its final output."""
        self.attach_matcher(request_id, grammar.new_matcher())
        self._tracked[request_id].grammar = grammar

    def get(self, request_id: str) -> Request | None:
        """The tracked (unfinished) request with this id, if any."""
        t = self._tracked.get(request_id)
        return t.request if t is not None else None

    def tracked(self, request_id: str) -> TrackedRequest:
        return self._tracked[request_id]

    # ---- before the pass ------------------------------------------------------------------
    def propose_drafts(self, decoding: list[Request]) -> dict[str, list[int]]:
        """Draft tokens for every decoding request that allows speculation, by id."""
        # NOTE: drafts never change a token (greedy or sampled: see the sampler), so every
        # request follows the break-even rate of the current batch size.
        break_even = lookup_break_even(len(decoding), self._spec_fixed_cost_rows)
        proposed: dict[str, list[int]] = {}
        for req in decoding:
            if not req.params.speculation:
                continue
            t = self._tracked[req.request_id]
            room = min(req.params.max_new_tokens - len(req.output_ids), self.max_model_len - req.seq_len) - 1
            if room <= 0:
                continue
            if t.prompt_text is None:
                t.prompt_text = self.tokenizer.decode(req.prompt_ids)  # type: ignore[attr-defined]
            texts = (t.prompt_text, t.detok.text)
            drafts, forced = self.proposer.propose(req.all_ids, t.matcher, t.spec, room, texts, break_even)
            t.drafts_from_lookup = bool(drafts) and not forced
            if t.drafts_from_lookup:
                t.spec.lookup_rounds += 1
                t.spec.lookup_draft_tokens += len(drafts)
            t.spec.forced_tokens += forced
            self.spec.forced_tokens += forced
            if drafts:
                proposed[req.request_id] = drafts
        return proposed

    # ---- after the pass: logits -> tokens --------------------------------------------------
    def sample(self, batch: ScheduledBatch, result: ForwardOutput) -> StepTokens:
        """New tokens of every request that produced some (verify items first)."""
        new = [self._verify(v.request, list(v.draft_ids), result.verify_logits[v.request.request_id])
               for v in batch.verify]
        new += self._sample_rows(result)
        return StepTokens(new, result.prompt_logprobs)

    def _verify(self, req: Request, drafts: list[int], rows: torch.Tensor) -> NewTokens:
        """Accept drafts exactly (see runtime.speculative.verify)."""
        t = self._tracked[req.request_id]
        tokens, accepted = verify_drafts(rows, drafts, req.params, t.matcher, t.seed,
                                         len(req.output_ids), self._stop_ids(t), t.history)
        self._count_spec(t, len(drafts), accepted, from_lookup=t.drafts_from_lookup)
        logprobs, top = self._logprobs_of(req.params, rows[: len(tokens)], tokens)
        return NewTokens(req, tokens, logprobs, top, verified=True)

    def _sample_rows(self, result: ForwardOutput) -> list[NewTokens]:
        if not result.sample_ids:
            return []
        tracked = [self._tracked[rid] for rid in result.sample_ids]
        reqs = [t.request for t in tracked]
        dead = set(mask_logits(result.logits, [t.matcher for t in tracked]))
        self._adjust_logits(result.logits, tracked)
        out = sample(result.logits, [r.params for r in reqs], [t.seed for t in tracked],
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
            req, t = n.request, self._tracked[n.request.request_id]
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

    def _record_prompt_logprobs(self, found: dict[str, list[tuple[int, float]]]) -> None:
        for rid, pairs in found.items():
            t = self._tracked[rid]
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
        """End ``req`` (idempotent): release it, then send its final output."""
        if req.finish_reason is not None:
            return
        req.finish_reason = reason
        self._release(req, reason)
        with self._lock:
            t = self._tracked.pop(req.request_id)
        if reason != "stop" or not t.detok.stopped:
            t.detok.finish(req.output_ids)
        self.num_finished += 1
        self._emit(t, error=error, check=self._check(t, reason))

    def _check(self, t: TrackedRequest, reason: FinishReason) -> ConstraintCheck | None:
        """The final output against its whole constraint (``CheckedGrammar.check``)."""
        if t.grammar is None or t.matcher is None or reason == "abort":
            return None
        # NOTE: a stop string or stop id cuts the text short of what the matcher consumed.
        grammar_end = (reason == "stop" and t.matcher.is_terminated() and not t.detok.stopped
                       and not t.request.params.stop_token_ids)
        check = t.grammar.check(t.detok.text, reason, grammar_end)
        self.checks.count(check)
        return check

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
