"""Turns a ``ForwardBatch`` into tensors, runs the model, returns the logits we need."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

import kernels
from kernels import AttentionPlan, SharedPrefix
from runtime.model.attention import AttentionMetadata
from runtime.model.fused_decode import FusedDecode
from runtime.model.kv_cache import KVCache
from runtime.model.llama import LlamaForCausalLM
from runtime.model.pooling import Pooling, pool
from runtime.scheduler.batch import ForwardBatch, ForwardSeq

# Attention reads a shared prefix once per group when that saves gathering at least this
# many tokens' K/V per layer: a group costs one more SDPA call and a merge per layer, worth
# hundreds of gathered tokens, and small overlapping groups below this saving made decode
# slower (docs/benchmarks.md#shared_prefix_attention_threshold).
MIN_SHARED_SAVING_TOKENS = 1024


@dataclass(frozen=True)
class ForwardOutput:
    """Logits of one forward pass, only where someone looks at them."""

    sample_ids: list[str]  # request ids that sample a token this step, in row order
    logits: torch.Tensor  # [len(sample_ids), vocab] float32 on the CPU
    # request_id -> [(prompt position, logprob of the prompt token there)]
    prompt_logprobs: dict[str, list[tuple[int, float]]]
    # request_id -> [len(token_ids), vocab] logits of every position of a verify seq
    verify_logits: dict[str, torch.Tensor]


class ModelRunner:
    """Runs the model on a ``ForwardBatch`` (plain values: it never sees a request)."""

    def __init__(
        self, model: LlamaForCausalLM, kv: KVCache, device: torch.device, fused: FusedDecode | None = None,
        invariant_attention: bool = True,
    ) -> None:
        self.model, self.kv, self.device = model, kv, device
        self.page_size = kv.page_size
        self.fused = fused  # decode-only batches run as one native call when set
        self.invariant_attention = invariant_attention  # AttentionMetadata.invariant

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if self.fused is not None and not batch.extend and batch.decode and self.fused.takes(len(batch.decode)):
            return self._forward_fused(batch.decode)
        input_ids, positions, slots = self._token_tensors(batch)
        meta = self._metadata(batch, slots)
        seqs = batch.extend + batch.decode
        offsets = _row_offsets(seqs)
        sampled = [(s, o) for s, o in zip(seqs, offsets, strict=True) if s.logits == "last"]
        verified = [(s, o) for s, o in zip(seqs, offsets, strict=True) if s.logits == "all"]
        lp_rows = [(o + row, s.request_id, pos, target) for s, o in zip(seqs, offsets, strict=True)
                   for row, pos, target in s.prompt_logprob_rows]
        rows = [o + len(s.token_ids) - 1 for s, o in sampled]
        rows += [o + j for s, o in verified for j in range(len(s.token_ids))]
        rows += [row for row, _, _, _ in lp_rows]
        index = torch.tensor(rows, dtype=torch.long).to(self.device)
        logits = self.model(input_ids, positions, meta, index).cpu()
        n_sample, n_verify = len(sampled), sum(len(s.token_ids) for s, _ in verified)
        verify_logits = dict(zip(
            [s.request_id for s, _ in verified],
            logits[n_sample : n_sample + n_verify].split([len(s.token_ids) for s, _ in verified]),
            strict=True,
        ))
        prompt_lp = self._prompt_logprobs(logits[n_sample + n_verify :], lp_rows)
        return ForwardOutput([s.request_id for s, _ in sampled], logits[:n_sample], prompt_lp,
                             verify_logits)

    def last_hidden(self, batch: ForwardBatch, pooling: Pooling = "last") -> torch.Tensor:  # [len(batch.extend), hidden] on the CPU
        """The final-norm hidden states of each extend seq, pooled (``runtime.model.pooling``:
        its last token's by default); nothing is sampled (the embeddings path: the seqs are
        whole prompts, ``batch.decode`` is empty)."""
        assert not batch.decode, "hidden states of prefill seqs only"
        input_ids, positions, slots = self._token_tensors(batch)
        offsets = _row_offsets(batch.extend)
        lengths = [len(s.token_ids) for s in batch.extend]
        if pooling == "mean":  # every row, averaged per seq on the CPU
            rows = [o + i for o, n in zip(offsets, lengths, strict=True) for i in range(n)]
        else:
            rows = [o + (n - 1 if pooling == "last" else 0) for o, n in zip(offsets, lengths, strict=True)]
        index = torch.tensor(rows, dtype=torch.long).to(self.device)
        hidden = self.model.hidden_states(input_ids, positions, self._metadata(batch, slots), index).cpu()
        return pool(hidden.float(), lengths, "mean") if pooling == "mean" else hidden

    def _forward_fused(self, seqs: tuple[ForwardSeq, ...]) -> ForwardOutput:
        """Every seq decodes one token and samples after it (decode seqs always do)."""
        assert self.fused is not None
        table = self._page_table([s.page_table for s in seqs])
        last = torch.tensor([s.start for s in seqs])  # the new token's position
        slots = table.gather(1, (last // self.page_size)[:, None]).flatten().long() * self.page_size \
            + last % self.page_size
        ids = torch.tensor([s.token_ids[0] for s in seqs])
        logits = self.fused.forward(ids, last, slots, table, (last + 1).int())
        return ForwardOutput([s.request_id for s in seqs], logits, {}, {})

    # ---- tensors ----------------------------------------------------------------------------
    def _token_tensors(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[torch.Tensor] = []
        for seq in batch.extend:
            end = seq.start + len(seq.token_ids)
            ids.extend(seq.token_ids)
            pos.extend(range(seq.start, end))
            slots.append(self._slots(seq.page_table, torch.arange(seq.start, end)))
        for seq in batch.decode:
            ids.append(seq.token_ids[0])
            pos.append(seq.start)
        if batch.decode:
            last = torch.tensor([seq.start for seq in batch.decode])
            table = self._page_table([seq.page_table for seq in batch.decode])
            page = table.gather(1, (last // self.page_size)[:, None]).flatten().long()
            slots.append(page * self.page_size + last % self.page_size)
        as_long = dict(dtype=torch.long, device=self.device)
        return (torch.tensor(ids, **as_long), torch.tensor(pos, **as_long),  # type: ignore[arg-type]
                torch.cat(slots).to(self.device))

    def _slots(self, pages: tuple[int, ...], positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(pages, dtype=torch.long)
        return table[positions // self.page_size] * self.page_size + positions % self.page_size

    @staticmethod
    def _page_table(page_lists: list[tuple[int, ...]]) -> torch.Tensor:  # [B, max_pages] int32
        width = max((len(p) for p in page_lists), default=0) or 1
        return torch.tensor([(*p, *[0] * (width - len(p))) for p in page_lists], dtype=torch.int32)

    def _metadata(self, batch: ForwardBatch, slots: torch.Tensor) -> AttentionMetadata:
        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        # The extend part: prefill chunks, then verify seqs (newest token + drafts).
        ext_lens = [len(s.token_ids) for s in batch.extend]
        ext_starts = [s.start for s in batch.extend]
        indptr = [0]
        for n in ext_lens:
            indptr.append(indptr[-1] + n)
        ext_table = self._page_table([s.page_table for s in batch.extend])
        dec_table = self._page_table([s.page_table for s in batch.decode])
        dec_starts = [s.start for s in batch.decode]
        meta = AttentionMetadata(
            kv=self.kv,
            out_slots=slots,
            num_extend_tokens=indptr[-1],
            extend_page_table=ext_table.to(self.device),
            extend_prefix_lens=i32(ext_starts),
            extend_lens=i32(ext_lens),
            extend_qo_indptr=i32(indptr),
            decode_page_table=dec_table.to(self.device),
            decode_seq_lens=i32([n + 1 for n in dec_starts]),
            window_plans=self._window_plans(batch, ext_table, dec_table, ext_starts, ext_lens, indptr, dec_starts),
            invariant=self.invariant_attention,
        )
        if kernels.get_kernel_backend(self.device) == "triton":
            return meta  # the Triton kernels read the pool in place: nothing to plan
        extend_plan = kernels.plan_extend(
            meta.extend_page_table, meta.extend_prefix_lens, meta.extend_lens, meta.extend_qo_indptr,
            self.page_size, self._shared_prefixes(ext_table, ext_starts),
        ) if batch.extend else None
        decode_plan = kernels.plan_decode(
            meta.decode_page_table, meta.decode_seq_lens, self.page_size,
            self._shared_prefixes(dec_table, dec_starts),
        ) if batch.decode else None
        return dataclasses.replace(meta, extend_plan=extend_plan, decode_plan=decode_plan)

    def _window_plans(
        self, batch: ForwardBatch, ext_table: torch.Tensor, dec_table: torch.Tensor, ext_starts: list[int],
        ext_lens: list[int], indptr: list[int], dec_starts: list[int],
    ) -> dict[int, tuple[AttentionPlan | None, AttentionPlan | None]]:
        """(extend, decode) plans for each sliding window the model's layers use (torch
        path on every device; no shared prefixes: those are merged unmasked)."""
        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        plans = {}
        for window in sorted({w for w in self.model.args.layer_windows if w is not None}):
            extend = kernels.plan_extend(
                ext_table.to(self.device), i32(ext_starts), i32(ext_lens), i32(indptr), self.page_size, (), window,
            ) if batch.extend else None
            decode = kernels.plan_decode(
                dec_table.to(self.device), i32([n + 1 for n in dec_starts]), self.page_size, (), window,
            ) if batch.decode else None
            plans[window] = (extend, decode)
        return plans

    def _shared_prefixes(self, table: torch.Tensor, starts: list[int]) -> tuple[SharedPrefix, ...]:
        """Groups of rows whose leading pages are the same pool pages.

        Rows are grouped by their first page; a group shares the pages that all its members
        have in common, up to the page holding any member's first new token (``starts``).
        """
        if table.shape[0] < 2:
            return ()
        limits = torch.tensor(starts) // self.page_size  # whole pages before the first query
        first = table[:, 0]
        groups = []
        for page in first.unique().tolist():
            rows = (first == page).nonzero().flatten()
            if rows.numel() < 2 or page == 0:
                continue
            same = (table[rows] == table[rows[0]]).int().cumprod(dim=1).sum(dim=1)
            n = int(torch.minimum(same, limits[rows]).min())
            if (rows.numel() - 1) * n * self.page_size < MIN_SHARED_SAVING_TOKENS:
                continue
            groups.append(SharedPrefix(table[rows[0], :n].long().to(self.device), rows.to(self.device)))
        return tuple(groups)

    @staticmethod
    def _prompt_logprobs(
        logits: torch.Tensor, rows: list[tuple[int, str, int, int]]
    ) -> dict[str, list[tuple[int, float]]]:
        """Log-probabilities of the asked-for prompt tokens; ``rows`` are (flat row,
        request id, prompt position, prompt token there) in the order of ``logits``."""
        out: dict[str, list[tuple[int, float]]] = {}
        if not rows:
            return out
        logp = torch.log_softmax(logits, dim=-1)
        picked = logp[torch.arange(len(rows)), torch.tensor([t for *_, t in rows])].tolist()
        for (_, rid, pos, _), lp in zip(rows, picked, strict=True):
            out.setdefault(rid, []).append((pos, lp))
        return out


def _row_offsets(seqs: tuple[ForwardSeq, ...]) -> list[int]:
    """The flat batch row of each seq's first token (extend seqs, then decode seqs)."""
    offsets, total = [], 0
    for s in seqs:
        offsets.append(total)
        total += len(s.token_ids)
    return offsets
