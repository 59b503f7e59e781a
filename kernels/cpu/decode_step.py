"""The fused decode step for the CPU in C (``decode_step.c``): the wrapper that checks the
model and the pool once, lays the weights' pointers out as the C structs, and checks each
step's inputs.

The weights and the pool are the model's own tensors (nothing is copied); a bound step
keeps references to them, so they live as long as it does.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.cpu.build import build_library
from kernels.cpu.decode_attention import KV_KINDS, MAX_DIM, MAX_HEADS
from kernels.reference.quant import QuantizedWeight

_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SOURCES = ("quant_linear", "decode_attention", "store_kv", "elementwise", "moe_experts")


class _QWeight(ctypes.Structure):  # ArborQWeight
    _fields_ = [("codes", _P), ("d", _P), ("m", _P), ("bias", _P), ("n_out", _I), ("k_len", _I),
                ("kp", _I), ("num_groups", _I), ("group_shift", ctypes.c_int32), ("bits", ctypes.c_int32),
                ("tiled", ctypes.c_int32)]


class _Layer(ctypes.Structure):  # ArborDecodeLayer
    _fields_ = [("qkv", _QWeight), ("o", _QWeight), ("gate_up", _QWeight), ("down", _QWeight),
                ("input_norm", _P), ("post_norm", _P), ("k", _P), ("v", _P), ("k_scale", _P),
                ("v_scale", _P), ("window", _I), ("router", _P), ("num_experts", _I), ("top_k", _I),
                ("normalize_topk", ctypes.c_int32), ("q_norm", _P), ("k_norm", _P)]


class _Model(ctypes.Structure):  # ArborDecodeModel
    _fields_ = [("num_layers", _I), ("hidden", _I), ("inter", _I), ("num_heads", _I),
                ("num_kv_heads", _I), ("head_dim", _I), ("vocab", _I), ("eps", _F),
                ("attn_scale", _F), ("attn_softcap", _F), ("kv_kind", ctypes.c_int32), ("num_slots", _I), ("page_size", _I),
                ("layers", ctypes.POINTER(_Layer)), ("final_norm", _P), ("lm_head", _QWeight)]


@dataclass(frozen=True)
class DecodeExperts:
    """A layer's router when its MLP is a mixture of experts (Qwen3-MoE, Mixtral)."""

    router: torch.Tensor  # [num_experts, hidden] fp32
    top_k: int  # experts per token
    normalize_topk: bool  # renormalize the top-k probabilities to sum to 1

    @property
    def num_experts(self) -> int:
        return int(self.router.shape[0])


@dataclass(frozen=True)
class DecodeLayerWeights:
    """One decoder layer as the fused step reads it (fused q/k/v and gate/up rows). With
    ``experts``, ``gate_up`` and ``down`` hold every expert's rows stacked, as
    ``kernels.ExpertWeights`` does: [E * 2I, hidden] (per expert gate rows, then up rows)
    and [E * hidden, I]."""

    qkv: QuantizedWeight  # [Hq*D + 2*Hkv*D, hidden]
    qkv_bias: torch.Tensor | None  # [Hq*D + 2*Hkv*D] fp32 (Qwen2), or None
    o: QuantizedWeight  # [hidden, Hq*D]
    gate_up: QuantizedWeight  # [2*inter, hidden]: gate rows, then up rows
    down: QuantizedWeight  # [hidden, inter]
    input_norm: torch.Tensor  # [hidden] fp32
    post_norm: torch.Tensor  # [hidden] fp32
    window: int | None = None  # attend to the last ``window`` positions only (a sliding-window layer)
    experts: DecodeExperts | None = None  # the MLP is a mixture of experts
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None  # [D] fp32 each: RMSNorm over each q, k head (Qwen 3)


@dataclass(frozen=True)
class DecodeModelWeights:
    """The whole model for the fused step; the embedding lookup stays with the caller."""

    layers: tuple[DecodeLayerWeights, ...]
    final_norm: torch.Tensor  # [hidden] fp32
    lm_head: QuantizedWeight  # [vocab, hidden]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float  # RMSNorm epsilon
    attn_scale: float | None = None  # the scores' scale (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (None: none)


@dataclass(frozen=True)
class DecodePool:
    """The paged KV pool the step reads and writes (``runtime.model.kv_cache`` layout)."""

    k: tuple[torch.Tensor, ...]  # per layer [num_slots, Hkv, D], fp32 / int8 / fp8
    v: tuple[torch.Tensor, ...]
    k_scale: tuple[torch.Tensor, ...] | None  # per layer [num_slots, Hkv] fp32 (8-bit pools)
    v_scale: tuple[torch.Tensor, ...] | None
    page_size: int


class UnsupportedDecodeModel(ValueError):
    """The model or pool is not one the fused step handles (the caller keeps the layer-by-
    layer path)."""


class CpuDecodeStep:
    """The compiled library; ``bind`` checks a model and pool and returns the step."""

    def __init__(self, cache_dir: Path) -> None:
        lib = build_library("decode_step", cache_dir, with_sources=_SOURCES)
        self._step = lib.arbor_decode_step
        self._step.argtypes = [ctypes.POINTER(_Model), _I, _P, _P, _P, _P, _P, _I, _P, _P, _P, _I, _N]
        self._step.restype = ctypes.c_int
        self._scratch = lib.arbor_decode_scratch_bytes
        self._scratch.argtypes, self._scratch.restype = [ctypes.POINTER(_Model), _I, _I, _N], _I
        lib.arbor_quant_tiles.restype = ctypes.c_int
        self.tiles = bool(lib.arbor_quant_tiles())  # reads tiled weights (quant_linear.py)

    def bind(self, weights: DecodeModelWeights, pool: DecodePool) -> BoundDecodeStep:
        """Raises ``UnsupportedDecodeModel`` naming what does not fit."""
        every = [w for layer in weights.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if not self.tiles and any(w.tiled for w in [*every, weights.lm_head]):
            raise UnsupportedDecodeModel("tiled weights need the AVX-512 VNNI build of the kernels")
        return BoundDecodeStep(self._step, self._scratch, weights, pool)


def _cpu(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        raise UnsupportedDecodeModel(f"{name} must be a contiguous {dtype} CPU tensor, got "
                                     f"{t.dtype} on {t.device}")
    return t


def _window(window: int | None, name: str) -> int:
    """The C struct's window (0: none)."""
    if window is not None and window < 1:
        raise UnsupportedDecodeModel(f"{name} has an attention window of {window}; it must be >= 1")
    return window or 0


def _qweight(w: QuantizedWeight, rows: int, cols: int, name: str, bias: torch.Tensor | None = None) -> _QWeight:
    if (w.out_features, w.in_features) != (rows, cols):
        raise UnsupportedDecodeModel(f"{name} is [{w.out_features}, {w.in_features}], expected [{rows}, {cols}]")
    for part, t in (("codes", w.codes), ("scales", w.scales), ("offsets", w.offsets)):
        _cpu(t, t.dtype, f"{name}.{part}")
    if bias is not None:
        _cpu(bias, torch.float32, f"{name} bias")
    return _QWeight(w.codes.data_ptr(), w.scales.data_ptr(), w.offsets.data_ptr(),
                    0 if bias is None else bias.data_ptr(), w.out_features, w.in_features,
                    w.padded_features, w.num_groups, w.group_shift, w.bits, int(w.tiled))


class BoundDecodeStep:
    """The fused step over one model and pool: ``__call__`` runs a decode-only batch.

    One caller at a time (the engine thread): the scratch buffer is the step's own."""

    def __init__(self, step: Any, scratch_fn: Any, weights: DecodeModelWeights, pool: DecodePool) -> None:
        self._step, self._scratch_fn = step, scratch_fn
        self._keep: list[Any] = [weights, pool]  # the pointers below point into these
        self.hidden = hidden = int(weights.final_norm.shape[0])
        self.vocab = weights.lm_head.out_features
        hq, hkv, dim = weights.num_heads, weights.num_kv_heads, weights.head_dim
        if hkv < 1 or hq % hkv or hq > MAX_HEADS or dim > MAX_DIM or dim % 2:
            raise UnsupportedDecodeModel(f"{hq} query heads over {hkv} KV heads of dim {dim}")
        if not weights.layers or len(pool.k) != len(weights.layers):
            raise UnsupportedDecodeModel("the pool needs one K/V buffer pair per layer")
        kind = KV_KINDS.get(pool.k[0].dtype)
        if kind is None:
            raise UnsupportedDecodeModel(f"KV pool dtype {pool.k[0].dtype}")
        self.num_slots = int(pool.k[0].shape[0])
        dense = [lw for lw in weights.layers if lw.experts is None]
        inter = dense[0].gate_up.out_features // 2 if dense else 0
        moe = [lw.experts for lw in weights.layers if lw.experts is not None]
        if len({(e.num_experts, e.top_k) for e in moe}) > 1:
            raise UnsupportedDecodeModel("layers with different numbers of experts or top-k")
        layers = (_Layer * len(weights.layers))()
        for i, lw in enumerate(weights.layers):
            layers[i] = self._layer(lw, pool, i, kind, hidden, inter, hq, hkv, dim)
        if len({layers[i].down.k_len for i, lw in enumerate(weights.layers) if lw.experts is not None}) > 1:
            raise UnsupportedDecodeModel("layers with experts of different intermediate sizes")
        widths = {layers[0].qkv.kp, layers[0].gate_up.kp}
        head = _qweight(weights.lm_head, self.vocab, hidden, "lm_head")
        if len(widths | {head.kp}) != 1:
            raise UnsupportedDecodeModel("qkv, gate_up and lm_head must share one padded width")
        self._layers = layers
        if weights.attn_softcap is not None and not weights.attn_softcap > 0:
            raise UnsupportedDecodeModel(f"an attention soft-cap must be > 0, got {weights.attn_softcap}")
        scale = dim**-0.5 if weights.attn_scale is None else weights.attn_scale
        self._model = _Model(len(weights.layers), hidden, inter, hq, hkv, dim, self.vocab, weights.eps,
                             scale, weights.attn_softcap or 0.0, kind, self.num_slots, pool.page_size, layers,
                             _cpu(weights.final_norm, torch.float32, "final_norm").data_ptr(), head)
        self.page_size = pool.page_size
        self._buffer = torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def _layer(lw: DecodeLayerWeights, pool: DecodePool, i: int, kind: int, hidden: int, inter: int,
               hq: int, hkv: int, dim: int) -> _Layer:
        name = f"layers[{i}]"
        k, v = pool.k[i], pool.v[i]
        shape = (k.shape[0], hkv, dim)
        if tuple(k.shape) != shape or tuple(v.shape) != shape:
            raise UnsupportedDecodeModel(f"{name} pool is {tuple(k.shape)}, expected [num_slots, {hkv}, {dim}]")
        _cpu(k, k.dtype, f"{name}.k"), _cpu(v, k.dtype, f"{name}.v")
        scales = (0, 0)
        if kind != 0:
            if pool.k_scale is None or pool.v_scale is None:
                raise UnsupportedDecodeModel("an 8-bit pool needs its row scales")
            ks = _cpu(pool.k_scale[i], torch.float32, f"{name}.k_scale")
            vs = _cpu(pool.v_scale[i], torch.float32, f"{name}.v_scale")
            scales = (ks.data_ptr(), vs.data_ptr())
        qkv_rows = (hq + 2 * hkv) * dim
        experts, mlp = lw.experts, (2 * inter, hidden, hidden, inter)
        if experts is not None:
            e = experts.num_experts
            _cpu(experts.router, torch.float32, f"{name}.router")
            if experts.router.dim() != 2 or experts.router.shape[1] != hidden or not 1 <= experts.top_k <= e:
                raise UnsupportedDecodeModel(f"{name}.router is {tuple(experts.router.shape)} with top-"
                                             f"{experts.top_k}, expected [num_experts, {hidden}]")
            if lw.gate_up.out_features % (2 * e):
                raise UnsupportedDecodeModel(f"{name}.gate_up's rows do not split into {e} experts")
            per_expert = lw.gate_up.out_features // (2 * e)
            mlp = (lw.gate_up.out_features, hidden, hidden * e, per_expert)
        return _Layer(
            _qweight(lw.qkv, qkv_rows, hidden, f"{name}.qkv", lw.qkv_bias),
            _qweight(lw.o, hidden, hq * dim, f"{name}.o"),
            _qweight(lw.gate_up, mlp[0], mlp[1], f"{name}.gate_up"),
            _qweight(lw.down, mlp[2], mlp[3], f"{name}.down"),
            _cpu(lw.input_norm, torch.float32, f"{name}.input_norm").data_ptr(),
            _cpu(lw.post_norm, torch.float32, f"{name}.post_norm").data_ptr(),
            k.data_ptr(), v.data_ptr(), *scales, _window(lw.window, name),
            0 if experts is None else experts.router.data_ptr(), 0 if experts is None else experts.num_experts,
            0 if experts is None else experts.top_k, int(experts is not None and experts.normalize_topk),
            *BoundDecodeStep._qk_norms(lw, name, dim),
        )

    @staticmethod
    def _qk_norms(lw: DecodeLayerWeights, name: str, dim: int) -> tuple[int, int]:
        if lw.qk_norms is None:
            return 0, 0
        q, k = (_cpu(w, torch.float32, f"{name}.{part}_norm") for w, part in zip(lw.qk_norms, "qk", strict=True))
        if tuple(q.shape) != (dim,) or tuple(k.shape) != (dim,):
            raise UnsupportedDecodeModel(f"{name}'s q/k norms must be [{dim}]")
        return q.data_ptr(), k.data_ptr()

    def __call__(
        self,
        h: torch.Tensor,  # [B, hidden] fp32 embeddings of the new tokens (overwritten)
        cos: torch.Tensor,  # [B, D/2] fp32
        sin: torch.Tensor,  # [B, D/2] fp32
        slots: torch.Tensor,  # [B] int64 pool slot of each new token
        page_table: torch.Tensor,  # [B, max_pages] int32
        seq_lens: torch.Tensor,  # [B] int32, tokens in the pool after this step's
    ) -> torch.Tensor:  # [B, vocab] fp32 logits
        batch = h.shape[0]
        if h.dtype != torch.float32 or tuple(h.shape) != (batch, self.hidden) or not h.is_contiguous():
            raise ValueError(f"h must be contiguous fp32 [B, {self.hidden}], got {h.dtype} {tuple(h.shape)}")
        for name, t, dtype in (("slots", slots, torch.int64), ("seq_lens", seq_lens, torch.int32)):
            if t.dtype != dtype or tuple(t.shape) != (batch,):
                raise ValueError(f"{name} must be {dtype} [{batch}], got {t.dtype} {tuple(t.shape)}")
        if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] != batch:
            raise ValueError(f"page_table must be int32 [{batch}, max_pages]")
        cos, sin = cos.contiguous(), sin.contiguous()
        table, slots, lens = page_table.contiguous(), slots.contiguous(), seq_lens.contiguous()
        logits = torch.empty(batch, self.vocab, dtype=torch.float32)
        if batch == 0:
            return logits
        max_len = int(lens.max())
        if max_len > table.shape[1] * self.page_size or int(lens.min()) < 1:
            raise ValueError("a sequence length lies outside the KV pool or page table")
        threads = torch.get_num_threads()
        need = int(self._scratch_fn(ctypes.byref(self._model), batch, max_len, threads)) + 64
        if self._buffer.numel() < need:
            self._buffer = torch.empty(need, dtype=torch.uint8)
        base = self._buffer.data_ptr()
        aligned = (base + 63) // 64 * 64  # NOTE: the C side lays its arrays out 64-byte aligned
        status = self._step(ctypes.byref(self._model), batch, h.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                            slots.data_ptr(), table.data_ptr(), table.shape[1], lens.data_ptr(),
                            logits.data_ptr(), aligned, need - (aligned - base), threads)
        if status == 1:
            raise ValueError("a slot, sequence length or page id lies outside the KV pool or page table")
        if status != 0:
            raise ValueError(f"decode step kernel refused its arguments (status {status})")
        return logits
