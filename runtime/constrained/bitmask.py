"""Token bitmasks: allocation and applying them to logits, vectorised over the batch.

Layout: ``bitmask[b, w]`` (int32) holds tokens ``32*w .. 32*w + 31``; bit ``k`` (value
``1 << k``, bit 31 being the sign bit) set means token ``32*w + k`` is allowed.
"""

from __future__ import annotations

import torch


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 ``[batch_size, ceil(vocab_size / 32)]`` bitmask, all tokens allowed."""
    return torch.full((batch_size, bitmask_width(vocab_size)), -1, dtype=torch.int32)


_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    if device not in _SHIFTS_CACHE:
        _SHIFTS_CACHE[device] = torch.arange(32, dtype=torch.int32, device=device)
    return _SHIFTS_CACHE[device]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, W]`` int32 bitmask → ``[B, vocab_size]`` bool (True = allowed).

    Tokens past ``32 * W`` (a logits width larger than the mask) come out disallowed.
    """
    batch, width = bitmask.shape
    bits = (bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1  # [B, W, 32]
    allowed = bits.view(batch, width * 32).bool()  # [B, 32 * W]
    if vocab_size <= width * 32:
        return allowed[:, :vocab_size]
    pad = torch.zeros(batch, vocab_size - width * 32, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | list[int] | None = None
) -> None:
    """Set disallowed logits to -inf, in place.

    Args:
        logits: ``[B, V]`` float tensor, any device.
        bitmask: ``[B, W]`` int32 bitmask (moved to ``logits.device`` if needed).
        rows: batch rows to mask (indexes both tensors); None masks every row.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(
            f"logits [B, V] and bitmask [B, W] must share B; got {tuple(logits.shape)} "
            f"and {tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if rows is None:
        logits.masked_fill_(~unpack_bitmask(bitmask, logits.shape[1]), float("-inf"))
        return
    idx = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
    allowed = unpack_bitmask(bitmask.index_select(0, idx), logits.shape[1])  # [R, V]
    masked = logits.index_select(0, idx).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, idx, masked)


def allowed_token_ids(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The allowed token ids of one ``[W]`` bitmask row (for tests and tools)."""
    allowed = unpack_bitmask(bitmask_row.unsqueeze(0), vocab_size)[0]
    return [int(i) for i in allowed.nonzero().flatten().tolist()]
