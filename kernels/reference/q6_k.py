"""Q6_K held as GGUF stores it: the byte layouts of ``QuantizedWeight(bits=6)`` (see
``kernels.reference.quant``), tensor to tensor.

A Q6_K superblock holds 256 weights: 6-bit codes q (0..63), an int8 scale sc_j per
sub-block of 16 and one fp16 d, ``w = (d * sc_j) * (q - 32)`` (gguf's dequantizer, in that
order). We keep d in ``scales`` (``offsets`` = -32 d) and everything else in ``codes``:
6.5 bits a weight in the row layout, as in the file; 8.5 in tiles.

Row layout (what the file holds, less d): per superblock, 208 bytes::

    [0, 128)   ql: element 128h + 32r + i (h < 2, r < 4, i < 32) in byte 64h + 32(r & 1) + i,
               low nibble for r < 2, high for r >= 2
    [128, 192) qh: its top two bits in byte 128 + 32h + i, bits 2r, 2r + 1
    [192, 208) sc: int8, sub-block j = element // 16

Tiled layout (16 rows, what the AVX-512 VNNI kernel reads): the codes widened to a byte
each, as the 8-bit tiled layout holds them (unpacking 6-bit codes cost the kernel more
than the bytes they save: docs/gguf.md), so 8.5 bits a weight; per tile and superblock,
4,352 bytes::

    [8 blocks][8 chunks][16 rows][4 bytes]   chunk c of block b: elements 32b + 4c .. + 3
    [16 sub-blocks][16 rows] int8 scales     a block's two sub-blocks: chunks 0-3, 4-7
"""

from __future__ import annotations

import torch

SUPER = 256  # elements of a superblock
SUB = 16  # elements per sub-block scale
FILE_BYTES = 210  # a superblock in the file: ql, qh, sc, d
ROW_BYTES = 208  # a superblock in the row layout (the file's, less d)
TILED_ROW_BYTES = 272  # a superblock of one row in the tiled layout: 256 codes, 16 scales
TILE_ROWS = 16


def from_blocks(raw: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q6_K tensor's raw blocks (uint8 [N, K / 256 * 210]) -> (codes in the row layout
    [N, K / 256 * 208], d float16 [N, K / 256]); both copies."""
    if in_features % SUPER:
        raise ValueError(f"a Q6_K row holds whole superblocks of {SUPER}, got {in_features} features")
    n, ns = raw.shape[0], in_features // SUPER
    blocks = raw.reshape(n, ns, FILE_BYTES)
    d = blocks[:, :, ROW_BYTES:].contiguous().view(torch.float16).view(n, ns)
    return blocks[:, :, :ROW_BYTES].reshape(n, ns * ROW_BYTES).contiguous(), d


def unpack(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row layout [N, ns * 208] -> (q uint8 [N, ns * 256] in 0..63, sc int8 [N, ns * 16])."""
    n = codes.shape[0]
    blocks = codes.reshape(n, -1, ROW_BYTES)
    ns = blocks.shape[1]
    ql = blocks[:, :, :128].reshape(n, ns, 2, 2, 32)  # [h, r & 1, i]
    low = torch.cat([ql & 0x0F, ql >> 4], dim=3)  # [h, r, i]: r = 0, 1 low nibbles, 2, 3 high
    qh = blocks[:, :, 128:192].reshape(n, ns, 2, 1, 32)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=codes.device).view(4, 1)
    q = low | (((qh >> shifts) & 3) << 4)  # [n, ns, h, r, i]
    sc = blocks[:, :, 192:].contiguous().view(torch.int8)
    return q.reshape(n, ns * SUPER), sc.reshape(n, ns * SUPER // SUB)


def pack(q: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """The inverse of ``unpack``."""
    n = q.shape[0]
    qv = q.to(torch.uint8).reshape(n, -1, 2, 4, 32)  # [n, ns, h, r, i]
    ns = qv.shape[1]
    nib = qv & 0x0F
    ql = torch.stack([nib[:, :, :, 0] | (nib[:, :, :, 2] << 4), nib[:, :, :, 1] | (nib[:, :, :, 3] << 4)], dim=3)
    top = (qv >> 4).to(torch.int32) << torch.arange(0, 8, 2, device=q.device).view(4, 1)
    qh = top.sum(dim=3).to(torch.uint8)  # [n, ns, h, i]
    scb = sc.contiguous().view(torch.uint8).reshape(n, ns, 16)
    return torch.cat([ql.reshape(n, ns, 128), qh.reshape(n, ns, 64), scb], dim=2).reshape(n, ns * ROW_BYTES)


def dequantize(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:  # [N, ns * 256] float32
    """``(d * sc_j) * (q - 32)`` from the row layout, gguf's arithmetic bit for bit."""
    q, sc = unpack(codes)
    scale = d.float().repeat_interleave(SUPER // SUB, dim=1) * sc.float()  # [N, sub-blocks], exact
    return (scale.repeat_interleave(SUB, dim=1) * (q.float() - 32.0)).contiguous()


# Rows tiled at a time: the temporaries (int32 bit fields) of a whole 49152-row head would
# add ~1.5 GB to a load's peak memory.
TILE_CHUNK_ROWS = 1024


def tile(codes: torch.Tensor) -> torch.Tensor:
    """Row layout -> tiled layout (N a multiple of 16), the same shape."""
    if codes.shape[0] > TILE_CHUNK_ROWS:
        return torch.cat([_tile(part) for part in codes.split(TILE_CHUNK_ROWS)])
    return _tile(codes)


def _tile(codes: torch.Tensor) -> torch.Tensor:
    q, sc = unpack(codes)
    n, k = q.shape
    t, ns = n // TILE_ROWS, k // SUPER
    chunks = q.view(t, TILE_ROWS, ns, SUPER // 4, 4).permute(0, 2, 3, 1, 4)  # [t, s, chunk, r, byte]
    scales = sc.contiguous().view(torch.uint8).view(t, TILE_ROWS, ns, 16).permute(0, 2, 3, 1)  # [t, s, j, r]
    tiled = torch.cat([chunks.reshape(t, ns, -1), scales.reshape(t, ns, -1)], dim=2)
    return tiled.reshape(n, ns * TILED_ROW_BYTES).contiguous()


def tiled_rows(tiled: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of a tiled layout, in the row layout."""
    n, row_bytes = tiled.shape
    ns = row_bytes // TILED_ROW_BYTES
    t, r = index // TILE_ROWS, index % TILE_ROWS
    tiles = tiled.view(n // TILE_ROWS, ns, TILE_ROWS * TILED_ROW_BYTES)
    # NOTE: advanced indices split by slices put the indexed dim first: [L, s, chunk, byte]
    q = tiles[:, :, : SUPER * TILE_ROWS].reshape(-1, ns, SUPER // 4, TILE_ROWS, 4)[t, :, :, r, :]
    sc = tiles[:, :, SUPER * TILE_ROWS:].reshape(-1, ns, 16, TILE_ROWS)[t, :, :, r]  # [L, s, j]
    return pack(q.reshape(len(index), ns * SUPER), sc.contiguous().view(torch.int8).reshape(len(index), -1))


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[N, K]`` (K a multiple of 256) -> (codes in the row layout, d float16
    [N, K / 256]): a plain Q6_K quantizer (round to nearest, no search): sub-block scale
    s_j = max|w| / 32 with the sign of the extreme, d = max_j |s_j| / 127, sc_j =
    round(s_j / d), q = round(w / (d sc_j)) + 32 clamped to 0..63."""
    n, k = weight.shape
    if k % SUPER:
        raise ValueError(f"Q6_K rows hold whole superblocks of {SUPER}, got {k} features")
    subs = weight.float().reshape(n, k // SUPER, SUPER // SUB, SUB)
    extreme = subs.gather(3, subs.abs().argmax(dim=3, keepdim=True)).squeeze(3)  # [n, ns, 16]
    s = -extreme / 32.0  # the extreme lands on code 0 (-32)
    d = (s.abs().amax(dim=2) / 127.0).half()  # [n, ns]
    d32 = d.float()[:, :, None]
    sc = torch.where(d32 > 0, torch.round(s / torch.where(d32 > 0, d32, 1.0)), 0.0).clamp(-128, 127)
    step = (d32 * sc)[:, :, :, None]  # [n, ns, 16, 1]
    q = torch.where(step != 0, torch.round(subs / torch.where(step != 0, step, 1.0)), 0.0) + 32
    codes = q.clamp(0, 63).to(torch.uint8).reshape(n, k)
    return pack(codes, sc.to(torch.int8).reshape(n, -1)), d


def to_blocks(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Row layout and d -> the file's blocks (uint8 [N, ns * 210]); ``from_blocks``'s inverse."""
    n, ns = d.shape
    rows = codes.reshape(n, ns, ROW_BYTES)
    return torch.cat([rows, d.contiguous().view(torch.uint8).reshape(n, ns, 2)], dim=2).reshape(n, ns * FILE_BYTES)
