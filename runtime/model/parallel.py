"""Tensor parallelism: shard a loaded Llama-family model across ranks (Megatron-style).

Per rank, for a world of ``W`` ranks (``ShardPlan``)::

    qkv_proj      column-parallel: the rank's q heads and the kv heads they read
    o_proj        row-parallel: the rank's q heads' input columns, then an all-reduce
    gate_up_proj  column-parallel: the rank's slice of the intermediate size (gate and up)
    down_proj     row-parallel: that slice's input columns, then an all-reduce
    embed_tokens  vocab-parallel: the rank's rows; ids outside them give 0; all-reduce
    lm_head       vocab-parallel: the rank's rows' logits, all-gathered (a tied head gets
                  its own slice of the embedding)

KV heads are split across ranks when there are at least ``W`` of them (contiguous groups,
as even as possible: 3 KV heads on 2 ranks are 2 + 1, with their q heads), else every rank
keeps the KV heads its q heads read (replicated). Each rank's KV pool holds only its own
KV heads. Norms, rotary tables and the residual stream are replicated.

``shard_model`` slices the weights (before linears are prepacked); ``add_collectives``
wraps the row-parallel and vocab-parallel modules with their collectives (after).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.errors import InvalidRequestError
from runtime.model.llama import Attention, DecoderLayer, LlamaForCausalLM, ModelArgs


def partition(n: int, world: int) -> list[range]:
    """``range(n)`` cut into ``world`` contiguous parts, the first ``n % world`` one longer."""
    base, extra = divmod(n, world)
    bounds = [0]
    for r in range(world):
        bounds.append(bounds[-1] + base + (r < extra))
    return [range(bounds[r], bounds[r + 1]) for r in range(world)]


@dataclass(frozen=True)
class ShardPlan:
    """What one rank holds (global indices)."""

    rank: int
    world: int
    q_heads: range
    kv_heads: range
    inter: range  # slice of the intermediate size
    vocab: range  # rows of the embedding / LM head
    vocab_size: int  # the whole vocabulary (every rank's rows)

    @classmethod
    def build(cls, args: ModelArgs, rank: int, world: int) -> ShardPlan:
        if world > args.num_heads:
            raise InvalidRequestError(f"tensor_parallel_size {world} exceeds the model's {args.num_heads} heads")
        group = args.num_heads // args.num_kv_heads  # q heads per kv head
        if args.num_kv_heads >= world:
            kv = partition(args.num_kv_heads, world)[rank]
            q = range(kv.start * group, kv.stop * group)
        else:  # fewer kv heads than ranks: split q heads, replicate the kv heads they read
            q = partition(args.num_heads, world)[rank]
            kv = range(q.start // group, (q.stop - 1) // group + 1)
            if len(q) % len(kv) or any((h // group) - kv.start != (h - q.start) // (len(q) // len(kv))
                                       for h in q):
                raise InvalidRequestError(
                    f"tensor_parallel_size {world} splits the {args.num_heads} q heads across the "
                    f"{args.num_kv_heads} kv heads unevenly (rank {rank}: q heads {q.start}-{q.stop - 1}); "
                    f"use a size that divides the q heads per kv head")
        if world > args.intermediate_size or world > args.vocab_size:
            raise InvalidRequestError(f"tensor_parallel_size {world} is too large for this model")
        return cls(rank, world, q, kv, partition(args.intermediate_size, world)[rank],
                   partition(args.vocab_size, world)[rank], args.vocab_size)

    def local_args(self, args: ModelArgs) -> ModelArgs:
        """The rank's architecture numbers (its heads and intermediate slice; the vocab
        stays global: it is what the engine samples over)."""
        return dataclasses.replace(args, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads),
                                   intermediate_size=len(self.inter))


def shard_model(model: LlamaForCausalLM, plan: ShardPlan) -> None:
    """Slice ``model``'s weights in place to ``plan`` (plain ``nn.Linear`` modules: call
    before ``prepack_linears``)."""
    args, d = model.args, model.args.head_dim
    q_size, kv_size = args.num_heads * d, args.num_kv_heads * d
    q_rows = _rows(plan.q_heads, d)
    kv_rows = _rows(plan.kv_heads, d)
    qkv_rows = torch.cat([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows])
    inter_rows = torch.arange(plan.inter.start, plan.inter.stop)
    gate_up_rows = torch.cat([inter_rows, args.intermediate_size + inter_rows])
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.dense_mlp("tensor parallelism")
        attn.qkv_proj = _linear(attn.qkv_proj, rows=qkv_rows)
        attn.o_proj = _linear(attn.o_proj, cols=q_rows)
        _set_heads(attn, len(plan.q_heads), len(plan.kv_heads))
        mlp.gate_up_proj = _linear(mlp.gate_up_proj, rows=gate_up_rows)
        mlp.down_proj = _linear(mlp.down_proj, cols=inter_rows)
        mlp.inter = len(plan.inter)
    vocab_rows = torch.arange(plan.vocab.start, plan.vocab.stop)
    embed = model.embed_tokens
    assert isinstance(embed, nn.Embedding), "tensor parallelism shards fp32 weights only (EngineConfig)"
    head = model.lm_head if model.lm_head is not None else _tied_head(embed)
    model.lm_head = _linear(head, rows=vocab_rows)
    model.embed_tokens = nn.Embedding(len(plan.vocab), args.hidden_size, _weight=embed.weight.data[vocab_rows].clone(),
                                      device=embed.weight.device, dtype=embed.weight.dtype)
    model.args = plan.local_args(args)


def add_collectives(model: LlamaForCausalLM, plan: ShardPlan, group: dist.ProcessGroup | None = None) -> None:
    """Wrap the row-parallel linears with an all-reduce and the embedding / LM head with
    their vocab-parallel collectives (after any prepacking)."""
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        layer.self_attn.o_proj = AllReduce(layer.self_attn.o_proj, group)
        mlp = layer.dense_mlp("tensor parallelism")
        mlp.down_proj = AllReduce(mlp.down_proj, group)
    assert isinstance(model.embed_tokens, nn.Embedding)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, plan, group)
    assert model.lm_head is not None
    model.lm_head = VocabParallelHead(model.lm_head, plan, group)


class AllReduce(nn.Module):
    """A row-parallel layer: the inner module's partial sums, summed over ranks."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelEmbedding(nn.Module):
    """Token lookup over the rank's rows; other ranks' ids give 0 here, so the sum over
    ranks is the full lookup."""

    def __init__(self, local: nn.Embedding, plan: ShardPlan, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = local.weight
        self.start, self.num_rows, self.group = plan.vocab.start, len(plan.vocab), group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_rows)
        out = F.embedding(local.clamp(0, self.num_rows - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(nn.Module):
    """Each rank's vocab rows' logits, gathered into the full ``[N, vocab]`` on every rank.
    NOTE: gloo gathers equal sizes only: the shorter parts are padded, then trimmed."""

    def __init__(self, inner: nn.Module, plan: ShardPlan, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.inner, self.group = inner, group
        self.sizes = [len(p) for p in partition(plan.vocab_size, plan.world)]

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        local = self.inner(h)
        width = max(self.sizes)
        if local.shape[-1] < width:
            local = F.pad(local, (0, width - local.shape[-1]))
        parts = [torch.empty_like(local) for _ in self.sizes]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat([p[:, :n] for p, n in zip(parts, self.sizes, strict=True)], dim=-1)


def _rows(heads: range, head_dim: int) -> torch.Tensor:
    return torch.arange(heads.start * head_dim, heads.stop * head_dim)


def _linear(src: nn.Module, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> nn.Linear:
    assert isinstance(src, nn.Linear), "shard before prepacking"
    weight, bias = src.weight.data, src.bias.data if src.bias is not None else None
    if rows is not None:
        weight = weight[rows]
        bias = bias[rows] if bias is not None else None
    if cols is not None:
        weight = weight[:, cols]  # NOTE: a row-parallel bias would be added W times; none here
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    out.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return out


def _tied_head(embed: nn.Embedding) -> nn.Linear:
    head = nn.Linear(embed.weight.shape[1], embed.weight.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(embed.weight.data, requires_grad=False)
    return head


def _set_heads(attn: Attention, num_heads: int, num_kv_heads: int) -> None:
    attn.num_heads, attn.num_kv_heads = num_heads, num_kv_heads
    q_size, kv_size = num_heads * attn.head_dim, num_kv_heads * attn.head_dim
    attn.split = (q_size, kv_size, kv_size)
