"""Full next-token distributions of whole sequences: the scoring path of ``arbor eval``.

Serving returns what a request asks for (sampled tokens, a few top logprobs, the logprob
of each prompt token); a quality replay needs every position's whole distribution (KL,
top-1 agreement). The scorer runs the same model runner, kernels and KV dtype as serving
on a KV pool of its own, sized for one sequence, so it never takes pages from the
scheduler and sees exactly the arithmetic (quantized KV included) that serving does::

    token_ids:  t0  t1  t2 ... t[L-1]
    logits row: 0   1   2  ... L-1        row i = the distribution of t[i+1] given t0..ti
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.model.kv_cache import KVCache
from runtime.model.llama import LlamaForCausalLM
from runtime.model.pooling import Pooling
from runtime.model.runner import ModelRunner
from runtime.scheduler.batch import ForwardBatch, ForwardSeq, LogitsWanted


class Scorer:
    """Logits of every position of a sequence, one prefill pass (not thread-safe: the
    engine calls it between steps)."""

    def __init__(self, model: LlamaForCausalLM, kv_dtype: torch.dtype, page_size: int,
                 device: torch.device) -> None:
        self.model, self.kv_dtype, self.page_size, self.device = model, kv_dtype, page_size, device

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:  # [L, vocab] fp32 on the CPU
        """Returns row ``i`` = logits of the token after ``token_ids[:i + 1]``.

        Raises:
            ValueError: an empty sequence.
        """
        if not token_ids:
            raise ValueError("nothing to score: the sequence is empty")
        runner, (seq,) = self._prefill([token_ids], "all")
        with torch.inference_mode():
            out = runner.forward(ForwardBatch((seq,), ()))
        return out.verify_logits["0"]

    def last_hidden(self, sequences: Sequence[Sequence[int]], pooling: Pooling = "last") -> torch.Tensor:  # [B, hidden] on the CPU
        """The final-norm hidden states of each sequence, pooled (its last token's by
        default), all in one prefill pass (the embeddings path: no logits, nothing sampled).

        Raises:
            ValueError: no sequences, or an empty one.
        """
        if not sequences or not all(sequences):
            raise ValueError("nothing to embed: no sequences, or an empty one")
        runner, seqs = self._prefill(sequences, "none")
        with torch.inference_mode():
            return runner.last_hidden(ForwardBatch(tuple(seqs), ()), pooling)

    def _prefill(self, sequences: Sequence[Sequence[int]], logits: LogitsWanted) -> tuple[ModelRunner, list[ForwardSeq]]:
        """A runner over a KV pool of its own that holds exactly ``sequences``, and their seqs."""
        pages = [-(-len(ids) // self.page_size) for ids in sequences]
        args = self.model.args
        kv = KVCache(args.num_layers, sum(pages) + 1, self.page_size, args.num_kv_heads, args.head_dim,
                     self.kv_dtype, self.device)  # page 0: padding
        firsts = [1 + sum(pages[:i]) for i in range(len(pages))]
        seqs = [ForwardSeq(str(i), tuple(ids), 0, tuple(range(first, first + n)), logits)
                for i, (ids, first, n) in enumerate(zip(sequences, firsts, pages, strict=True))]
        return ModelRunner(self.model, kv, self.device), seqs
