"""Block-quantized weights: the format, its conversions, and the reference matmul (the
specification of ``kernels/cpu/quant_linear.c``).

A weight row is cut into blocks of 32 input features; every group of blocks has an fp16
scale ``d`` and offset ``m``, and each element is an unsigned code::

    w[n, k] = d[n, g] * code[n, k] + m[n, g]          g = (k // 32) // blocks_per_group

That one form holds every format we load or make:

    format           bits  group            code               m
    Q4_1 (GGUF)         4  32               q                  m
    Q4_0 (GGUF)         4  32               q                  -8 d
    Q5_1 (GGUF)         5  32               q                  m
    Q5_0 (GGUF)         5  32               q                  -16 d
    Q4_K / Q5_K         4/5  32             q                  -dmin m_j  (d sc_j in d; fp16)
    Q8_0 (GGUF)         8  32               q + 128            -128 d
    "int4" (ours)       4  32..128          round((w-min)/d)   min        (asymmetric)
    "int8" (ours)       8  whole row        q + 128            -128 d     (per channel)

and one more, held as the file holds it (``kernels.reference.q6_k``): Q6_K, ``bits=6``, groups
of 256 (``blocks_per_group=8``) with ``d`` in ``scales`` and ``offsets = -32 d``, its 6-bit
codes and int8 scales of 16 elements in ``codes``: ``w = (d * sc_j) * (code - 32)``.

Code layout (``codes``, uint8), rows padded with zero codes to ``padded_features``, a
multiple of 64 (the padded columns' scales are 0 or meet zero activations)::

    8 bits: one byte per element                                   [N, Kp]
    5 bits: per 64-element superblock, the 4-bit layout's 32 bytes of low nibbles, then
            8 bytes (a little-endian uint64) whose bit i is element i's fifth bit
                                                                   [N, Kp / 64 * 40]
    6 bits: per 256 elements, the file's 208 bytes (q6_k.py)       [N, Kp / 256 * 208]
            (tiled: [N, Kp / 256 * 272], the codes a byte each)
    4 bits: per 64-element superblock, byte i = element i (low nibble) | element 32+i (high)
                                                                   [N, Kp / 2]

so a 32-byte load and one shift give two whole blocks of codes in order.

Tiled layout (``tiled=True``; ``tile`` / ``untile``): what the AVX-512 VNNI kernel reads, so
that one 64-byte load is vpdpbusd's operand for 16 rows at once. N is a multiple of 16;
rows 16t..16t+15 form tile t, and each tensor keeps its shape, but the bytes of
``codes[16t:16t+16]`` and the values of ``scales[16t:16t+16]`` (``offsets`` likewise) are
the tile's, in this order::

    8 bits: [Kp / 4 chunks][16 rows][4 bytes]   chunk c: inputs 4c .. 4c + 3
    4 bits: [Kp / 32 blocks][4 chunks][16 rows][4 bytes]   byte q of chunk c of block b:
            input 32b + 4c + q (low nibble) | input 32b + 16 + 4c + q (high nibble)
    5 bits: per block, the 4-bit tile's 256 bytes of nibbles, then 8 little-endian uint64
            masks [4 chunks][2 halves]: bit 4r + q of mask (c, h) is the fifth bit of row r's
            input 32b + 16h + 4c + q (the byte lane of that code in the chunk's low (h = 0)
            or high (h = 1) nibbles): 320 bytes a block, 5 bits a weight as in rows
    6 bits: q6_k.py ("Tiled layout")
    scales, offsets: [G][16 rows]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kernels.reference import q6_k

BLOCK = 32  # input features per block (the activations' quantization block too)
SUPERBLOCK = 64  # two blocks: the unit of the 4-bit code layout and of row padding
TILE_ROWS = 16  # rows of a tile in the tiled layout
GGML_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}  # per 32 elements
K_ELEMENTS = 256  # a K-quant superblock's elements
# superblock bytes: d, dmin (f16), 12 bytes of 6-bit scales and mins, [32 bytes of 5th bits], 128 of nibbles
K_BYTES = {"Q4_K": 144, "Q5_K": 176}
GGML_KINDS = (*GGML_BLOCK_BYTES, *K_BYTES, "Q6_K")  # the GGUF block types loaded without dequantizing


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized ``[out_features, in_features]`` weight (see the module docstring)."""

    codes: torch.Tensor  # uint8 [N, Kp] (8 bits), [N, Kp / 64 * 40] (5 bits) or [N, Kp / 2] (4 bits)
    scales: torch.Tensor  # float16 [N, num_groups], d
    offsets: torch.Tensor  # float16 [N, num_groups], m
    bits: int  # 4, 5, 6 (Q6_K) or 8
    blocks_per_group: int | None  # a power of two; None: one group per row (per channel)
    in_features: int  # K, before padding
    tiled: bool = False  # the tiled layout (module docstring); N a multiple of TILE_ROWS

    def __post_init__(self) -> None:
        if self.bits not in (4, 5, 6, 8):
            raise ValueError(f"bits must be 4, 5, 6 or 8, got {self.bits}")
        bpg = self.blocks_per_group
        if bpg is not None and (bpg < 1 or bpg & (bpg - 1)):
            raise ValueError(f"blocks_per_group must be a power of two or None, got {bpg}")
        if self.bits == 6 and (bpg != q6_k.SUPER // BLOCK or self.in_features % q6_k.SUPER):
            raise ValueError(f"6-bit (Q6_K) weights have groups of {q6_k.SUPER} and whole ones, got "
                             f"blocks_per_group={bpg}, {self.in_features} features")
        row_bytes = self.row_bytes
        n = self.codes.shape[0]
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != (n, row_bytes):
            raise ValueError(f"codes must be uint8 [{n}, {row_bytes}], got {self.codes.dtype} "
                             f"{tuple(self.codes.shape)}")
        if self.tiled and n % TILE_ROWS:
            raise ValueError(f"a tiled weight has a multiple of {TILE_ROWS} rows, got {n}")
        groups = (n, self.num_groups)
        for name, t in (("scales", self.scales), ("offsets", self.offsets)):
            if t.dtype != torch.float16 or tuple(t.shape) != groups:
                raise ValueError(f"{name} must be float16 {list(groups)}, got {t.dtype} {tuple(t.shape)}")

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def padded_features(self) -> int:  # Kp
        return -(-self.in_features // SUPERBLOCK) * SUPERBLOCK

    @property
    def row_bytes(self) -> int:  # bytes of codes per row
        if self.bits == 6:
            return self.padded_features // q6_k.SUPER * (q6_k.TILED_ROW_BYTES if self.tiled else q6_k.ROW_BYTES)
        return self.padded_features * self.bits // 8  # 5 bits: 40 bytes a superblock, rows or tiles

    @property
    def num_blocks(self) -> int:
        return self.padded_features // BLOCK

    @property
    def num_groups(self) -> int:
        if self.blocks_per_group is None:
            return 1
        return -(-self.num_blocks // self.blocks_per_group)

    @property
    def group_shift(self) -> int:
        """log2(blocks per group); 31 for one group per row (every block index >> 31 is 0)."""
        return 31 if self.blocks_per_group is None else self.blocks_per_group.bit_length() - 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of the rows ``index`` (a permutation, a token lookup...), in the row
        layout (a tiled weight's rows are gathered from their tiles)."""
        if self.tiled:
            return _tiled_rows(self, index)
        return QuantizedWeight(self.codes.index_select(0, index), self.scales.index_select(0, index),
                               self.offsets.index_select(0, index), self.bits, self.blocks_per_group,
                               self.in_features)

    def to(self, device: torch.device) -> QuantizedWeight:
        return QuantizedWeight(self.codes.to(device), self.scales.to(device), self.offsets.to(device),
                               self.bits, self.blocks_per_group, self.in_features, self.tiled)


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format along the output dim (the fused q/k/v, gate/up)."""
    first = parts[0]
    if any(p.tiled for p in parts):
        raise ValueError("concatenate weights in the row layout, then tile them")
    for p in parts[1:]:
        if (p.bits, p.blocks_per_group, p.in_features) != (first.bits, first.blocks_per_group, first.in_features):
            raise ValueError("can only concatenate quantized weights of one format and width")
    return QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           torch.cat([p.offsets for p in parts]), first.bits, first.blocks_per_group,
                           first.in_features)


# ---- codes <-> layout ----------------------------------------------------------------------
FIFTH_BYTES = 8  # 5 bits: bytes of fifth bits per 64 codes (a superblock in rows, a chunk's two halves in tiles)


def _bits_to_bytes(bits: torch.Tensor) -> torch.Tensor:  # [..., 64] of 0 / 1 -> [..., 8] uint8, bit i in byte i // 8
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32, device=bits.device)
    return (bits.to(torch.int32).unflatten(-1, (8, 8)) * weights).sum(-1).to(torch.uint8)


def _bytes_to_bits(packed: torch.Tensor) -> torch.Tensor:  # [..., 8] uint8 -> [..., 64] of 0 / 1 (uint8)
    return ((packed[..., None] >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1).flatten(-2)


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, Kp] codes (0..2^bits-1, any int dtype) -> the stored uint8 layout."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    n, kp = codes.shape
    if bits == 5:
        nibbles = _pack_codes(codes & 0x0F, 4).view(n, kp // SUPERBLOCK, BLOCK)
        fifth = _bits_to_bytes((codes >> 4).view(n, kp // SUPERBLOCK, SUPERBLOCK))
        return torch.cat([nibbles, fifth], dim=2).reshape(n, -1).contiguous()
    pairs = codes.view(n, kp // SUPERBLOCK, 2, BLOCK)  # [N, superblock, (low, high) block, 32]
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, kp // 2).contiguous()


def _unpack_codes(w: QuantizedWeight) -> torch.Tensor:  # [N, Kp] uint8
    if w.bits == 8:
        return w.codes
    n = w.out_features
    if w.bits == 5:
        sbs = w.codes.view(n, -1, BLOCK + FIFTH_BYTES)
        packed = sbs[:, :, :BLOCK].reshape(n, -1, 1, BLOCK)
        low = torch.cat([packed & 0x0F, packed >> 4], dim=2).reshape(n, w.padded_features)
        return low | (_bytes_to_bits(sbs[:, :, BLOCK:]).reshape(n, w.padded_features) << 4)
    packed = w.codes.view(n, -1, 1, BLOCK)
    return torch.cat([packed & 0x0F, packed >> 4], dim=2).reshape(n, w.padded_features)


def _expand_groups(t: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:  # [N, G] -> [N, Kp] fp32
    per_group = w.padded_features if w.blocks_per_group is None else w.blocks_per_group * BLOCK
    return t.float().repeat_interleave(per_group, dim=1)[:, : w.padded_features]


def dequantize(w: QuantizedWeight) -> torch.Tensor:  # [N, K] float32
    """The fp32 weight the codes stand for: ``d * code + m`` (6 bits: ``q6_k.dequantize``)."""
    w = untile(w)
    if w.bits == 6:
        return q6_k.dequantize(w.codes, w.scales)
    full = _expand_groups(w.scales, w) * _unpack_codes(w).float() + _expand_groups(w.offsets, w)
    return full[:, : w.in_features].contiguous()


# ---- the tiled layout ------------------------------------------------------------------------
def tile(w: QuantizedWeight) -> QuantizedWeight:
    """``w`` in the tiled layout (module docstring): the same values, rearranged."""
    if w.tiled:
        return w
    n, t, kp = w.out_features, w.out_features // TILE_ROWS, w.padded_features
    if n % TILE_ROWS:
        raise ValueError(f"only a weight of a multiple of {TILE_ROWS} rows can be tiled, got {n}")
    if w.bits == 6:
        codes = q6_k.tile(w.codes)
    elif w.bits == 8:  # [t, r, chunk, q] -> [t, chunk, r, q]
        codes = w.codes.view(t, TILE_ROWS, kp // 4, 4).transpose(1, 2)
    elif w.bits == 5:
        codes = _tile5(_unpack_codes(w).view(t, TILE_ROWS, kp // BLOCK, 2, 4, 4))
    else:  # codes [t, r, block, half, chunk, q] -> bytes [t, block, chunk, r, q] of (low, high)
        c = _unpack_codes(w).view(t, TILE_ROWS, kp // BLOCK, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
        codes = c[..., 0] | (c[..., 1] << 4)
    return QuantizedWeight(codes.reshape(n, -1).contiguous(), _tile_groups(w.scales), _tile_groups(w.offsets),
                           w.bits, w.blocks_per_group, w.in_features, tiled=True)


def _tile5(c: torch.Tensor) -> torch.Tensor:
    """Codes [t, r, block, half, chunk, q] (0..31) -> the 5-bit tiles [t, block, 320]."""
    c = c.permute(0, 2, 4, 1, 5, 3)  # [t, block, chunk, r, q, half]
    t, nb = c.shape[0], c.shape[1]
    nibbles = ((c[..., 0] & 0x0F) | ((c[..., 1] & 0x0F) << 4)).reshape(t, nb, 4 * TILE_ROWS * 4)
    fifth = (c >> 4).permute(0, 1, 2, 5, 3, 4).reshape(t, nb, 4, 2, TILE_ROWS * 4)  # bit 4r + q of (chunk, half)
    return torch.cat([nibbles, _bits_to_bytes(fifth).reshape(t, nb, 8 * FIFTH_BYTES)], dim=2)


def _untile5(w: QuantizedWeight, t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Codes [L, Kp] (0..31) of rows (tile t, row r) of a 5-bit tiled weight."""
    tiles, nb = w.out_features // TILE_ROWS, w.padded_features // BLOCK
    blocks = w.codes.view(tiles, nb, 4 * TILE_ROWS * 4 + 8 * FIFTH_BYTES)
    nib = blocks[:, :, :256].reshape(tiles, nb, 4, TILE_ROWS, 4)[t, :, :, r, :]  # [L, block, chunk, q]
    fifth = _bytes_to_bits(blocks[:, :, 256:].reshape(tiles, nb, 4, 2, FIFTH_BYTES))  # [tiles, block, chunk, h, 64]
    high = fifth.view(tiles, nb, 4, 2, TILE_ROWS, 4)[t, :, :, :, r, :]  # [L, block, chunk, half, q]
    low = torch.stack([nib & 0x0F, nib >> 4], dim=3)  # [L, block, chunk, half, q]
    return (low | (high << 4)).permute(0, 1, 3, 2, 4).reshape(len(t), w.padded_features)


def untile(w: QuantizedWeight) -> QuantizedWeight:
    """``w`` in the row layout (the inverse of ``tile``)."""
    if not w.tiled:
        return w
    return _tiled_rows(w, torch.arange(w.out_features, device=w.codes.device))


def _tile_groups(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> per tile [G][16]
    n, g = t.shape
    return t.view(n // TILE_ROWS, TILE_ROWS, g).transpose(1, 2).reshape(n, g).contiguous()


def _tiled_rows(w: QuantizedWeight, index: torch.Tensor) -> QuantizedWeight:
    """Rows ``index`` of a tiled weight, in the row layout."""
    t, r = index // TILE_ROWS, index % TILE_ROWS
    tiles, kp, groups = w.out_features // TILE_ROWS, w.padded_features, w.num_groups
    # NOTE: advanced indices split by a slice put the indexed dim first: [L, ...]
    if w.bits == 6:
        codes = q6_k.tiled_rows(w.codes, index)
    elif w.bits == 8:
        codes = w.codes.view(tiles, kp // 4, TILE_ROWS, 4)[t, :, r, :].reshape(len(index), kp)
    elif w.bits == 5:
        codes = _pack_codes(_untile5(w, t, r), 5)
    else:
        chunks = w.codes.view(tiles, kp // BLOCK, 4, TILE_ROWS, 4)[t, :, :, r, :]  # [L, block, chunk, q]
        codes = _pack_codes(torch.stack([chunks & 0x0F, chunks >> 4], dim=2).reshape(len(index), kp), 4)
    scales = w.scales.view(tiles, groups, TILE_ROWS)[t, :, r]
    offsets = w.offsets.view(tiles, groups, TILE_ROWS)[t, :, r]
    return QuantizedWeight(codes.contiguous(), scales.contiguous(), offsets.contiguous(), w.bits,
                           w.blocks_per_group, w.in_features)


# ---- quantizing fp32 weights ---------------------------------------------------------------
def _pad_columns(weight: torch.Tensor) -> torch.Tensor:
    k = weight.shape[1]
    return F.pad(weight.float(), (0, -(-k // SUPERBLOCK) * SUPERBLOCK - k))


def _groups(padded: torch.Tensor, blocks_per_group: int | None) -> torch.Tensor:  # [N, G, group]
    n, kp = padded.shape
    size = kp if blocks_per_group is None else blocks_per_group * BLOCK
    return F.pad(padded, (0, -(-kp // size) * size - kp)).view(n, -1, size)


# Rows quantized at a time: the temporaries of a whole 49152-row embedding table would
# add ~0.5 GB to a load's peak memory.
QUANTIZE_CHUNK_ROWS = 4096


def _by_chunks(quantize: Any, weight: torch.Tensor, *args: Any) -> QuantizedWeight:
    if weight.shape[0] <= QUANTIZE_CHUNK_ROWS:
        return quantize(weight, *args)  # type: ignore[no-any-return]
    return cat_rows([quantize(part, *args) for part in weight.split(QUANTIZE_CHUNK_ROWS)])


def quantize_int8(weight: torch.Tensor, blocks_per_group: int | None = None) -> QuantizedWeight:
    """Symmetric int8, one scale per row (default) or per group: ``q = round(w / d)``,
    ``d = max|w| / 127``."""
    return _by_chunks(_quantize_int8, weight, blocks_per_group)


def quantize_int4(weight: torch.Tensor, blocks_per_group: int = 1) -> QuantizedWeight:
    """Asymmetric 4-bit per group (Q4_1's arithmetic): ``m = min``, ``d = (max - min) / 15``,
    ``q = round((w - m) / d)``."""
    return _by_chunks(_quantize_int4, weight, blocks_per_group)


def quantize_int5(weight: torch.Tensor, blocks_per_group: int = 1) -> QuantizedWeight:
    """Asymmetric 5-bit per group (Q5_1's arithmetic): ``m = min``, ``d = (max - min) / 31``,
    ``q = round((w - m) / d)``."""
    return _by_chunks(_quantize_int4, weight, blocks_per_group, 5)


def quantize_q6_k(weight: torch.Tensor) -> QuantizedWeight:
    """Q6_K (``q6_k.quantize``: 6-bit codes, an int8 scale per 16, fp16 d per 256); K a
    multiple of 256."""
    codes, d = q6_k.quantize(weight)
    return QuantizedWeight(codes, d, (-32.0 * d.float()).half(), 6, q6_k.SUPER // BLOCK, weight.shape[1])


def _quantize_int8(weight: torch.Tensor, blocks_per_group: int | None) -> QuantizedWeight:
    padded = _pad_columns(weight)
    groups = _groups(padded, blocks_per_group)
    d = (groups.abs().amax(dim=2) / 127.0).half()  # [N, G]
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round(groups * inv[:, :, None]).clamp(-127, 127).flatten(1)[:, : padded.shape[1]]
    return QuantizedWeight(_pack_codes(q.to(torch.int16) + 128, 8), d, (-128.0 * d.float()).half(), 8,
                           blocks_per_group, weight.shape[1])


def _quantize_int4(weight: torch.Tensor, blocks_per_group: int, bits: int = 4) -> QuantizedWeight:
    padded = _pad_columns(weight)
    groups = _groups(padded, blocks_per_group)
    top = (1 << bits) - 1
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    d, m = ((hi - lo) / top).half(), lo.half()
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(lo))
    q = torch.round((groups - m.float()[:, :, None]) * inv[:, :, None]).clamp(0, top)
    return QuantizedWeight(_pack_codes(q.flatten(1)[:, : padded.shape[1]], bits), d, m, bits, blocks_per_group,
                           weight.shape[1])


# ---- GGUF blocks ---------------------------------------------------------------------------
def from_ggml_blocks(raw: torch.Tensor, kind: str, in_features: int) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8 [N, K / 32 * block bytes]) in our layout, without
    dequantizing: the scales are copied bit for bit, the codes only rearranged.

    ``kind``: "Q4_0" (d f16, 16 bytes of nibbles: element j low, j + 16 high), "Q4_1" (d, m,
    nibbles), "Q5_0" / "Q5_1" (d, [m,] 4 bytes of fifth bits, nibbles: 5-bit codes, ``bits=5``), "Q8_0" (d, 32 int8), "Q4_K" or "Q5_K" (``_from_k_quant``: their block scales
    are rounded), "Q6_K" (as it is: ``q6_k``).
    """
    if kind not in GGML_KINDS:
        raise ValueError(f"unsupported GGUF block type {kind!r} (supported: {sorted(GGML_KINDS)})")
    if kind == "Q6_K":
        codes, d = q6_k.from_blocks(raw, in_features)
        return QuantizedWeight(codes, d, (-32.0 * d.float()).half(), 6, q6_k.SUPER // BLOCK, in_features)
    if kind in K_BYTES:
        return _from_k_quant(raw, kind, in_features)
    if in_features % BLOCK:
        raise ValueError(f"a {kind} row holds whole blocks of {BLOCK}, got {in_features} features")
    n, nb = raw.shape[0], in_features // BLOCK
    blocks = raw.reshape(n, nb, GGML_BLOCK_BYTES[kind])
    d = _f16(blocks, 0).view(n, nb)
    if kind == "Q8_0":
        codes = (blocks[:, :, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).view(n, -1)
        m = (-128.0 * d.float()).half()
    else:
        with_m = kind in ("Q4_1", "Q5_1")
        qs = blocks[:, :, 4 if with_m else 2:]
        if kind.startswith("Q5"):  # 4 bytes (little-endian) of the codes' fifth bits, then nibbles
            qh, qs = qs[:, :, :4].to(torch.int64), qs[:, :, 4:]
            fifth = (qh[:, :, 0:1] | qh[:, :, 1:2] << 8 | qh[:, :, 2:3] << 16 | qh[:, :, 3:4] << 24)
            high = ((fifth >> torch.arange(BLOCK)) & 1).to(torch.uint8) << 4  # [n, nb, 32]
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=2)  # elements 0..15, 16..31
        if kind.startswith("Q5"):
            codes = codes | high
        codes = codes.view(n, -1)
        zero = 16.0 if kind == "Q5_0" else 8.0  # Q4_0 / Q5_0: w = d (q - zero)
        m = _f16(blocks, 2).view(n, nb) if with_m else (-zero * d.float()).half()
    bits = 4 if kind.startswith("Q4") else 5 if kind.startswith("Q5") else 8
    kp = -(-in_features // SUPERBLOCK) * SUPERBLOCK
    pad_blocks = kp // BLOCK - nb
    codes = F.pad(codes, (0, kp - in_features))
    d, m = F.pad(d, (0, pad_blocks)), F.pad(m, (0, pad_blocks))  # padded blocks: d = m = 0
    return QuantizedWeight(_pack_codes(codes, bits), d.contiguous(), m.contiguous(), bits, 1, in_features)


def tiled_from_q4_blocks(raw: torch.Tensor, kind: str, in_features: int) -> QuantizedWeight:
    """Q4_0 / Q4_1 blocks (uint8 [N, K / 32 * block bytes], N a multiple of 16) straight in
    the tiled layout: a block's 16 bytes of nibbles (byte j: element j low, j + 16 high)
    are already the tiled layout's 4 chunks of 4 bytes of one block, so the bytes only move
    (one copy), instead of unpacking and repacking every code. Equals
    ``tile(from_ggml_blocks(raw, kind, in_features))``."""
    if kind not in ("Q4_0", "Q4_1") or in_features % BLOCK or raw.shape[0] % TILE_ROWS:
        raise ValueError(f"tiled_from_q4_blocks takes Q4_0 / Q4_1 rows of whole blocks in whole tiles, got {kind} "
                         f"{tuple(raw.shape)}")
    n, nb = raw.shape[0], in_features // BLOCK
    kp = -(-in_features // SUPERBLOCK) * SUPERBLOCK
    blocks = raw.reshape(n, nb, GGML_BLOCK_BYTES[kind])
    d = _f16(blocks, 0).view(n, nb)
    m = _f16(blocks, 2).view(n, nb) if kind == "Q4_1" else (-8.0 * d.float()).half()
    qs = blocks[:, :, 4 if kind == "Q4_1" else 2:]
    qs = F.pad(qs, (0, 0, 0, kp // BLOCK - nb)) if kp // BLOCK > nb else qs.contiguous()  # padded blocks: code 0
    # NOTE: a chunk's 4 bytes move together: permuted as one int32 each, 4x fewer elements
    chunks = qs.view(torch.int32).reshape(n // TILE_ROWS, TILE_ROWS, kp // BLOCK, 4)
    codes = chunks.permute(0, 2, 3, 1).contiguous().view(torch.uint8)  # [t, block, chunk, r] x 4 bytes
    pad = (0, kp // BLOCK - nb)  # padded blocks: d = m = 0
    return QuantizedWeight(codes.reshape(n, -1).contiguous(), _tile_groups(F.pad(d, pad).contiguous()),
                           _tile_groups(F.pad(m, pad).contiguous()), 4, 1, in_features, tiled=True)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:  # the fp16 at byte ``at`` of each block
    return blocks[..., at:at + 2].contiguous().view(torch.float16)


def _from_k_quant(raw: torch.Tensor, kind: str, in_features: int) -> QuantizedWeight:
    """Q4_K / Q5_K superblocks of 256 as groups of 32 (4-bit codes; Q5_K's 5-bit ones): sub-block j of a superblock has w = d * sc_j * q - dmin * m_j (6-bit sc_j,
    m_j packed in 12 bytes, as ggml's get_scale_min_k4 reads them). Q4_K's nibbles are
    already in our order (each 64 elements: byte i holds element i low, element 32 + i
    high), so they are copied; Q5_K adds bit j of byte i of its 32 ``qh`` bytes as the
    fifth bit of element i of sub-block j. A block's d * sc_j and -dmin * m_j, exact in
    fp32, are rounded to our fp16 (relative 2^-11)."""
    if in_features % K_ELEMENTS:
        raise ValueError(f"a {kind} row holds whole superblocks of {K_ELEMENTS}, got {in_features} features")
    n, ns = raw.shape[0], in_features // K_ELEMENTS
    blocks = raw.reshape(n, ns, K_BYTES[kind])
    d, dmin = _f16(blocks, 0).float(), _f16(blocks, 2).float()  # [n, ns, 1]
    q = blocks[:, :, 4:16].to(torch.int32)
    sc = torch.cat([q[:, :, 0:4] & 63, (q[:, :, 8:12] & 0xF) | ((q[:, :, 0:4] >> 6) << 4)], dim=2)
    mn = torch.cat([q[:, :, 4:8] & 63, (q[:, :, 8:12] >> 4) | ((q[:, :, 4:8] >> 6) << 4)], dim=2)
    scales = (d * sc.float()).half().view(n, ns * 8)
    offsets = (-(dmin * mn.float())).half().view(n, ns * 8)
    if kind == "Q4_K":
        return QuantizedWeight(blocks[:, :, 16:].contiguous().view(n, ns * 128), scales, offsets, 4, 1, in_features)
    qh = blocks[:, :, 16:48]  # [n, ns, 32]
    nibbles = blocks[:, :, 48:].view(n, ns, 4, 32)  # 4 x 64 elements: sub-block 2c low, 2c + 1 high
    codes = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=3).view(n, ns, 8, 32)
    fifth = (qh[:, :, None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1  # [n, ns, 8, 32]
    codes = (codes | (fifth << 4)).view(n, ns * 256)
    return QuantizedWeight(_pack_codes(codes, 5), scales, offsets, 5, 1, in_features)


def widen(w: QuantizedWeight, bits: int = 8) -> QuantizedWeight:
    """A 4- or 5-bit weight with its codes held in ``bits`` (5 or 8; the same values, so it
    can be stacked with a weight of that width and the same groups)."""
    if w.bits == bits:
        return w
    if w.bits == 6 or bits == 6:
        raise ValueError("6-bit (Q6_K) codes have scales per 16 elements: they cannot be widened")
    if bits not in (5, 8) or w.bits > bits:
        raise ValueError(f"cannot widen {w.bits}-bit codes to {bits} bits")
    w = untile(w)
    return QuantizedWeight(_pack_codes(_unpack_codes(w), bits), w.scales, w.offsets, bits, w.blocks_per_group,
                           w.in_features)


# ---- the matmul ----------------------------------------------------------------------------
def quantized_linear(
    x: torch.Tensor,  # [..., K]
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N]
    """The specification: ``x @ dequantize(weight).T + bias`` in fp32."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"expected {weight.in_features} input features, got {x.shape[-1]}")
    return F.linear(x.float(), dequantize(weight).to(x.device), bias)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, K] fp32
    """What the CPU kernel multiplies instead of ``x``: each block of 32 rounded to
    ``dx * round(x / dx)``, ``dx = max|x| / 127`` (llama.cpp's Q8_0 activations). The kernel
    equals ``quantized_linear(quantize_activations(x), w)`` up to fp32 summation order."""
    m, k = x.shape
    blocks = F.pad(x.float(), (0, -(-k // BLOCK) * BLOCK - k)).view(m, -1, BLOCK)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).flatten(1)[:, :k]


def bf16_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] bfloat16: dequantize(w).bfloat16()
    bias: torch.Tensor | None = None,  # [N] float32
) -> torch.Tensor:  # [..., N] float32
    """What the CPU's large-batch path computes where it has AVX512_BF16: ``x`` and the
    dequantized weight rounded to bf16 (8 significant bits each, products exact in fp32),
    multiplied with fp32 sums, the output rounded to bf16, then the fp32 bias added (about
    0.3% of the output from the fp32 spec, less than the kernel's int8 activations)."""
    out = F.linear(x.bfloat16(), weight).float()
    return out if bias is None else out + bias
