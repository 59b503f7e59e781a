"""A GGUF model's weights loaded as they are stored: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q6_K
blocks become ``QuantizedWeight`` codes and scales bit for bit (``weights="gguf"``), with no
fp32 copy (Q5_0 / Q5_1 / Q5_K as 5-bit codes; Q6_K as it is stored).

What conversion (``convert.py``, through transformers) does to the numbers, we do to rows:
llama.cpp stores a Llama model's q and k projections with the rows of each head
interleaved for its rotary layout; undoing that is a row permutation, which moves whole
quantized rows. Tensors in other types (F32/F16 norms, or a linear in a K-quant we have
no kernel for: Q2_K, Q3_K, ...) are dequantized with the ``gguf`` package; such a
linear is then quantized to int8 in groups of 32, and the log says so. Q4_K and Q5_K blocks
load as groups of 32 (their scales rounded to fp16: ``kernels.reference.quant._from_k_quant``).
Every one of these but Q6_K is a format of groups of 32, so parts of a fused weight stored
in different ones (a file's v in Q8_0, its q and k in Q4_K) stack without requantizing: 4-bit
parts are widened to the widest part's codes (``widen``: 4 to 5 bits beside Q5, to 8 beside Q8_0); a Q6_K part beside other types (its scales are
per 16 elements) is quantized to int8 in groups of 32 first.

Everything is read tensor by tensor from the file's memory map (``GGUFFile``); where the
kernels read tiles, Q4_0 / Q4_1 bytes go straight to the tiled layout
(``tiled_from_q4_blocks``). ``gguf_state_dict`` is the fp32 route (``weights="fp32"``, and
int8 / int4 from it): dequantized per tensor, never the whole model twice.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

import kernels
from kernels import QuantizedWeight
from kernels.cpu.gguf_repack import TILE8_KINDS
from kernels.reference.quant import (
    GGML_KINDS,
    TILE_ROWS,
    cat_rows,
    dequantize,
    from_ggml_blocks,
    quantize_int8,
    tiled_from_q4_blocks,
    widen,
)
from runtime.errors import ModelLoadError
from runtime.model.gguf_config import architecture
from runtime.model.gguf_file import GGUFFile, TensorInfo
from runtime.model.llama import DecoderLayer, LlamaForCausalLM, ModelArgs, RMSNorm
from runtime.model.mlp import mlp_block
from runtime.model.quant import QuantizedEmbedding, QuantizedLinear

log = logging.getLogger(__name__)


class GGUFTensors:
    """Name -> tensor of one GGUF file, read from its memory map tensor by tensor."""

    def __init__(self, gguf: GGUFFile, tiles: bool = False) -> None:
        self.gguf = gguf
        self.path = gguf.path
        # the kernels read tiles: build Q4_0 / Q4_1 weights straight in the tiled layout, and
        # keep Q6_K as stored (its fast path is the tiled one; elsewhere int8 in groups of 32)
        self.tiles = tiles

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def _raw(self, name: str) -> tuple[TensorInfo, np.ndarray]:  # [rows, row bytes] uint8 view of the map
        info = self.gguf.tensor(name)
        rows = info.num_elements // info.shape[0]
        return info, self.gguf.raw(name).reshape(rows, -1)

    def stacked(self, names: list[str], orders: list[torch.Tensor | None] | None = None) -> QuantizedWeight:
        """The weights ``names`` stacked along the output dim (a fused q/k/v or gate/up),
        rows of part i taken in ``orders[i]`` (None: as stored). Where the kernels read tiles
        and the C repacks take the parts' types (``_tiled_in_c``), one C pass from the file's
        bytes to the tiled layout (Q5_0 / Q5_1 parts to 5-bit tiles); else all-Q4_0 / all-Q4_1 parts through torch
        (``tiled_from_q4_blocks``), and the rest through ``quantized`` and ``_fused``."""
        infos = [self.gguf.tensor(n) for n in names]
        orders = orders or [None] * len(names)
        rows = sum(i.shape[1] for i in infos)
        kinds = {(i.type_name, i.shape[0]) for i in infos}
        if self.tiles and rows % TILE_ROWS == 0 and len({i.shape[0] for i in infos}) == 1:
            weight = self._tiled_in_c(names, orders, infos)
            if weight is not None:
                return weight
        if self.tiles and len(kinds) == 1 and infos[0].type_name in ("Q4_0", "Q4_1") and rows % TILE_ROWS == 0:
            parts = []
            with warnings.catch_warnings():  # the map is read-only; only read here
                warnings.simplefilter("ignore", UserWarning)
                for name, order in zip(names, orders, strict=True):
                    raw = torch.from_numpy(self._raw(name)[1])
                    parts.append(raw if order is None else raw.index_select(0, order))
            raw = parts[0] if len(parts) == 1 else torch.cat(parts)  # NOTE: one part is read from the map as is
            weight = tiled_from_q4_blocks(raw, infos[0].type_name, infos[0].shape[0])
            del parts, raw
            for name in names:
                self.gguf.release(name)
            return weight
        weights = [self.quantized(n) if o is None else self.quantized(n).rows(o) for n, o in zip(names, orders,
                                                                                                strict=True)]
        return weights[0] if len(weights) == 1 else _fused(names[0], weights)

    def _tiled_in_c(self, names: list[str], orders: list[torch.Tensor | None],
                    infos: list[TensorInfo]) -> QuantizedWeight | None:
        """``stacked``'s parts tiled by a C kernel straight from the map, in the format the
        torch path gives them: one 4-bit kind as 4-bit tiles, one 5-bit kind
        (Q5_0 / Q5_1) as 5-bit tiles, all-Q6_K parts of whole tiles
        as 6-bit tiles, and parts with Q8_0 or Q6_K among Q4_0 / Q4_1 / Q4_K / Q8_0 / Q6_K
        as 8-bit tiles (``_fused``'s widening and requantizing). None: no C kernel in use,
        or types it does not take (the caller's torch path then)."""
        kinds = [i.type_name for i in infos]
        addresses = []
        for name, order in zip(names, orders, strict=True):
            raw = self._raw(name)[1]
            index = np.arange(raw.shape[0], dtype=np.uint64) if order is None else order.numpy().astype(np.uint64)
            addresses.append(raw.ctypes.data + index * np.uint64(raw.shape[1]))
        in_features = infos[0].shape[0]
        weight = None
        if len(set(kinds)) == 1 and kinds[0] in ("Q4_0", "Q4_1", "Q4_K"):
            weight = kernels.tile_q4_blocks(np.concatenate(addresses), kinds[0], in_features)
        elif set(kinds) == {"Q6_K"} and all(self._q6_k_native(i) for i in infos):
            weight = kernels.tile_q6_k_blocks(np.concatenate(addresses), in_features)
        elif len(set(kinds)) == 1 and kinds[0] in ("Q5_0", "Q5_1"):
            weight = kernels.tile_q5_blocks(np.concatenate(addresses), kinds[0], in_features)
        elif set(kinds) <= set(TILE8_KINDS) and set(kinds) & {"Q8_0", "Q6_K"}:
            weight = kernels.tile8_blocks(list(zip(addresses, kinds, strict=True)), in_features)
        if weight is not None:
            for name in names:
                self.gguf.release(name)
        return weight

    def dense(self, name: str) -> torch.Tensor:  # [*shape] float32 (torch order), dequantized if need be
        return torch.from_numpy(self.gguf.dense(name))

    def _q6_k_native(self, info: TensorInfo) -> bool:
        return q6_k_native(info.num_elements // info.shape[0], self.tiles)

    def quantized(self, name: str) -> QuantizedWeight:
        """A 2-D weight ``[N, K]`` as ``QuantizedWeight`` (its own blocks where we have a
        kernel for them)."""
        info, raw = self._raw(name)
        in_features = info.shape[0]  # GGUF lists dims innermost first
        if info.type_name not in GGML_KINDS or (info.type_name == "Q6_K" and not self._q6_k_native(info)):
            log.info("GGUF tensor %s is %s: no fast kernel for it here, quantizing to int8 in groups of 32",
                     name, info.type_name)
            return quantize_int8(self.dense(name).reshape(-1, in_features), blocks_per_group=1)
        with warnings.catch_warnings():  # the map is read-only; from_ggml_blocks only reads it
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(raw)
        weight = from_ggml_blocks(blocks, info.type_name, in_features)  # new tensors: the one repack
        del blocks
        self.gguf.release(name)
        return weight




def q6_k_native(rows: int, tiles: bool) -> bool:
    """Whether a Q6_K weight of ``rows`` rows is held as stored: where the kernels read
    tiles and its rows fill whole tiles (the 6-bit row layout has only a portable kernel)."""
    return tiles and rows % TILE_ROWS == 0


def _unpermute_rows(num_heads: int, rows: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute)."""
    half = rows // num_heads // 2
    return torch.arange(rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(rows)


def _norm_names(args: ModelArgs) -> dict[str, str]:
    """A layer's norms: our module name -> llama.cpp's tensor name (below ``blk.N.``)."""
    names = {"input_layernorm": "attn_norm.weight", "post_attention_layernorm": "ffn_norm.weight"}
    if args.sandwich_norms:  # Gemma: the attention's and the MLP's output norms
        names.update({"attn_output_norm": "post_attention_norm.weight", "mlp_output_norm": "post_ffw_norm.weight"})
    return names


def _qkv_rows(args: ModelArgs) -> list[int]:
    return [args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim, args.num_kv_heads * args.head_dim]


Weights = dict[str, QuantizedWeight | torch.Tensor]  # our module names -> tensors


def load_gguf_model(gguf: GGUFFile, args: ModelArgs, max_positions: int, tiles: bool = False) -> LlamaForCausalLM:
    """Build the model with every linear and the embedding table in the file's own
    quantized blocks and the norms in fp32 (CPU tensors), read tensor by tensor from the
    file's memory map (each block tensor repacked once into our layout). ``tiles``: build
    Q4_0 / Q4_1 weights directly in the tiled layout (``kernels.reads_tiles()``)."""
    return _build(_read_gguf(GGUFTensors(gguf, tiles), args), args, max_positions)


def gguf_state_dict(gguf: GGUFFile, args: ModelArgs) -> dict[str, torch.Tensor]:
    """The model's weights dequantized to fp32, tensor by tensor from the map (``gguf``'s
    dequantization, q / k rows un-permuted as transformers does), under our module names
    (``loader.build_model``'s state dict)."""
    gg, permute = GGUFTensors(gguf), architecture(gguf).permuted_qk
    out = {"embed_tokens.weight": gg.dense("token_embd.weight"), "norm.weight": gg.dense("output_norm.weight")}
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = gg.dense("output.weight")
    for i in range(args.num_layers):
        pre, dst = f"blk.{i}.", f"layers.{i}."
        q, k, v = gg.dense(pre + "attn_qkv.weight").split(_qkv_rows(args)) if architecture(gguf).fused_qkv \
            else (gg.dense(pre + f"attn_{p}.weight") for p in "qkv")
        if permute:
            q = q.index_select(0, _unpermute_rows(args.num_heads, q.shape[0]))
            k = k.index_select(0, _unpermute_rows(args.num_kv_heads, k.shape[0]))
        out[dst + "self_attn.qkv_proj.weight"] = torch.cat([q, k, v])
        if args.qkv_bias:
            out[dst + "self_attn.qkv_proj.bias"] = torch.cat([gg.dense(pre + f"attn_{p}.bias") for p in "qkv"])
        out[dst + "self_attn.o_proj.weight"] = gg.dense(pre + "attn_output.weight")
        if args.qk_norm:
            for p in "qk":
                out[dst + f"self_attn.{p}_norm.weight"] = gg.dense(pre + f"attn_{p}_norm.weight").reshape(-1)
        out.update(mlp_block(args.mlp).gguf_state(gg, pre, dst + "mlp.", args))
        for ours, theirs in _norm_names(args).items():
            out[dst + ours + ".weight"] = gg.dense(pre + theirs).reshape(-1)
    return out


def _read_gguf(gg: GGUFTensors, args: ModelArgs) -> Weights:
    permute, fused = architecture(gg.gguf).permuted_qk, architecture(gg.gguf).fused_qkv
    out: Weights = {"norm": gg.dense("output_norm.weight").reshape(-1),
                    "embed_tokens": gg.stacked(["token_embd.weight"])}
    if gg.has("output.weight"):
        out["lm_head"] = gg.stacked(["output.weight"])
    for i in range(args.num_layers):
        pre, dst = f"blk.{i}.", f"layers.{i}."
        orders = [_unpermute_rows(args.num_heads, args.num_heads * args.head_dim),
                  _unpermute_rows(args.num_kv_heads, args.num_kv_heads * args.head_dim), None] if permute else None
        out[dst + "qkv_proj"] = gg.stacked([pre + "attn_qkv.weight"]) if fused \
            else gg.stacked([pre + f"attn_{p}.weight" for p in "qkv"], orders)
        if args.qkv_bias:
            out[dst + "qkv_bias"] = torch.cat([gg.dense(pre + f"attn_{p}.bias") for p in "qkv"])
        out[dst + "o_proj"] = gg.stacked([pre + "attn_output.weight"])
        if args.qk_norm:
            for p in "qk":
                out[dst + f"{p}_norm"] = gg.dense(pre + f"attn_{p}_norm.weight").reshape(-1)
        mlp = mlp_block(args.mlp).gguf_native(gg, pre, args)
        out.update({dst + "mlp." + name: w for name, w in mlp.items()})
        for ours, theirs in _norm_names(args).items():
            out[dst + ours] = gg.dense(pre + theirs).reshape(-1)
    return out


def _build(weights: Weights, args: ModelArgs, max_positions: int) -> LlamaForCausalLM:
    def quantized(name: str) -> QuantizedWeight:
        w = weights.get(name)
        if not isinstance(w, QuantizedWeight):
            raise ModelLoadError(f"quantized weight {name!r} missing")
        return w

    def dense(name: str) -> torch.Tensor:
        w = weights.get(name)
        if not isinstance(w, torch.Tensor):
            raise ModelLoadError(f"weight {name!r} missing")
        return w

    with torch.device("meta"):
        model = LlamaForCausalLM(args, max_positions)
    model.build_rope(max_positions)  # real buffers
    _set_norm(model.norm, dense("norm"))
    model.embed_tokens = QuantizedEmbedding(quantized("embed_tokens"))
    model.lm_head = QuantizedLinear(quantized("lm_head" if "lm_head" in weights else "embed_tokens"))
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        pre = f"layers.{i}."
        bias = dense(pre + "qkv_bias") if args.qkv_bias else None
        layer.self_attn.qkv_proj = QuantizedLinear(quantized(pre + "qkv_proj"), bias)
        layer.self_attn.o_proj = QuantizedLinear(quantized(pre + "o_proj"))
        if layer.self_attn.q_norm is not None and layer.self_attn.k_norm is not None:
            _set_norm(layer.self_attn.q_norm, dense(pre + "q_norm"))
            _set_norm(layer.self_attn.k_norm, dense(pre + "k_norm"))
        mlp = pre + "mlp."
        mlp_block(args.mlp).load_native(layer.mlp, {name[len(mlp):]: w for name, w in weights.items()
                                                    if name.startswith(mlp)})
        for ours in _norm_names(args):
            _set_norm(getattr(layer, ours), dense(pre + ours))
    return model.eval()


def _fused(name: str, parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts stacked into one weight. Parts of different code widths but the same groups (a
    file may keep v in Q8_0 and q, k in Q4) stack exactly, the narrower ones widened to the
    widest (4 bits beside Q5's 5 to 5, anything beside 8 to 8); a 6-bit (Q6_K) part among others is first quantized to int8 in groups of 32;
    parts of still different groups are requantized together to int8 per channel."""
    if len({p.bits for p in parts}) > 1 and any(p.bits == 6 for p in parts):
        log.info("GGUF %s: a Q6_K part beside other types, quantizing it to int8 in groups of 32", name)
        parts = [quantize_int8(dequantize(p), blocks_per_group=1) if p.bits == 6 else p for p in parts]
    if len({p.bits for p in parts}) > 1 and len({p.blocks_per_group for p in parts}) == 1:
        bits = max(p.bits for p in parts)  # 4-bit codes are 5-bit ones with a zero fifth bit
        parts = [widen(p, bits) for p in parts]
    if len({(p.bits, p.blocks_per_group) for p in parts}) == 1:
        return cat_rows(parts)
    log.info("GGUF %s: parts in different groups, quantizing the fused weight to int8", name)
    return quantize_int8(torch.cat([dequantize(p) for p in parts]))


def _set_norm(norm: RMSNorm, weight: torch.Tensor) -> None:
    norm.weight = torch.nn.Parameter(weight.reshape(-1), requires_grad=False)
