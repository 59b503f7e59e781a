"""The CPU path's second KV tier: evicted pages in a memory-mapped file on local disk.

``runtime/cache/kv_tier.py`` says what a tier does; ``tier_index.py`` keeps its keys,
slots and LRU order. This module moves the bytes. The file is a run of fixed-size slots,
one page each, in a page-first layout (all layers of one page together, as SGLang's
HiCache ``page_first`` host layout), so a page is one contiguous read::

    slot s (slot_bytes, a multiple of 64):
        codes  [2 * num_layers, page_size * kv_heads * head_dim]   K of layer 0, V of layer 0, K of 1, ...
        scales [2 * num_layers, page_size * kv_heads] fp32          (8-bit pages only)

Codes are the pool's own bytes (exact: a reload equals the pool hit it replaces), or, with
``int8=True`` on a float pool, int8 codes with one scale per (token, head) row as the int8
KV pool stores them (``kernels.reference.kv_quant``): ~3.8x the pages in the same bytes,
and a reload is as exact as an int8 pool (not bit-equal to the float pages it replaces).

Writes never block the engine step on the disk: ``store`` copies the evicted pages into a
staging buffer (memory) and a writer thread copies that into the mapping and checksums it
(the kernel writes the file back on its own). Until then a load of such a page reads the
staging buffer. Staging is bounded (``max_pending_bytes``); past it, evicted pages are
dropped (counted), never waited for. Each load checks the written page's crc32: a page
that fails is dropped and the request computes it instead.

The file is preallocated (``posix_fallocate``: a full disk fails here, at start, rather
than as a SIGBUS on a later write into the mapping) and unlinked at once, so it never
outlives the process.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import tempfile
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from kernels import is_quantized_kv
from kernels.reference.kv_quant import dequantize_kv, quantize_kv
from runtime.cache.kv_tier import KVTier, NoTier, TierMatch, TierStats, empty_tier_match
from runtime.cache.namespace import Namespace
from runtime.cache.tier_index import TierIndex
from runtime.model.kv_cache import KVCache

log = logging.getLogger("arbor.kv_tier")

DEFAULT_MAX_PENDING_BYTES = 512 * 2**20  # staging for writes not yet done
_ALIGN = 64


class TierUnavailableError(OSError):
    """The tier's file could not be made (a directory that is not writable, a full disk)."""


class DiskTier(KVTier):
    """Args:
        kv: the pool's KV tensors (pages are copied out of and back into them).
        directory: where the tier's file goes (made if missing).
        max_bytes: the file's size bound; it holds ``max_bytes // slot_bytes`` pages.
        int8: store a float pool's pages as int8 codes and scales (8-bit pools are stored
            as they are either way).

    Raises:
        TierUnavailableError: the file cannot be made or preallocated.
    """

    def __init__(self, kv: KVCache, directory: str | Path, max_bytes: int, int8: bool = False,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES) -> None:
        self.kv, self.stats = kv, TierStats()
        self.page_size = ps = kv.page_size
        num_layers, _, heads, dim = len(kv.k), *kv.k[0].shape
        self.quantized_pool = is_quantized_kv(kv.dtype)
        self.int8 = int8 and not self.quantized_pool
        self.code_dtype = torch.int8 if self.int8 else kv.dtype
        self._rows = 2 * num_layers  # K and V of each layer
        self._elems = ps * heads * dim  # codes per (page, layer, K|V)
        self._scaled = self.int8 or self.quantized_pool
        code_bytes = self._rows * self._elems * torch.empty((), dtype=self.code_dtype).element_size()
        self._code_bytes = code_bytes
        self._scale_elems = ps * heads if self._scaled else 0
        raw = code_bytes + self._rows * self._scale_elems * 4
        self.slot_bytes = -(-raw // _ALIGN) * _ALIGN
        num_slots = max_bytes // self.slot_bytes
        if num_slots < 1:
            raise ValueError(f"kv_tier_max_bytes={max_bytes} holds no page of {self.slot_bytes} bytes")
        self._file, self._map = _open_file(Path(directory), num_slots * self.slot_bytes)  # NOTE: first: it may fail
        self.index = TierIndex(num_slots, ps)
        self.max_pending_bytes = max_pending_bytes
        self._slots = np.frombuffer(self._map, dtype=np.uint8).reshape(num_slots, self.slot_bytes)
        self._staged: dict[int, np.ndarray] = {}  # slot -> its bytes, until written (index.lock)
        self._pending_bytes = 0
        self._queue: queue.Queue[tuple[list[int], np.ndarray] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="arbor-kv-tier", daemon=True)
        self._writer.start()
        self._closed = False
        log.info("KV tier: %d pages of %d bytes in %s%s", num_slots, self.slot_bytes, directory,
                 " (int8)" if self.int8 else "")

    # ---- the interface ----------------------------------------------------------------------
    def match(self, token_ids: list[int], namespace: Namespace, start: int) -> TierMatch:
        ps = self.page_size
        num_pages = len(token_ids) // ps
        if not self.index.num_pages or num_pages * ps <= start:
            return empty_tier_match(start)
        keys = self.index.keys(token_ids, namespace, num_pages)[start // ps :]
        if not self.index.holds(keys[0]):
            return empty_tier_match(start)
        slots = self.index.lookup(keys)
        return TierMatch(start, len(slots) * ps, tuple(slots), tuple(keys[: len(slots)]))

    def lock(self, match: TierMatch) -> None:
        self.index.lock_slots(match.slots)

    def unlock(self, match: TierMatch) -> None:
        self.index.unlock_slots(match.slots)

    def load(self, match: TierMatch, pages: list[int]) -> int:
        assert len(pages) == len(match.slots), "one pool page per tier page"
        good: list[tuple[int, np.ndarray | None]] = []  # (slot, its staged bytes or None: the file's)
        for slot in match.slots:
            try:
                source = self._verified(slot)
            except OSError:  # NOTE: a failing disk costs a recompute, never the request
                log.exception("KV tier read failed")
                source = False
            if source is False:
                self.stats.corrupt_pages += 1
                self.index.drop(slot)
                log.warning("KV tier page %d failed its checksum: dropped, recomputed instead", slot)
                break
            good.append((slot, source if isinstance(source, np.ndarray) else None))
        # NOTE: straight from the mapping into the pool, a run of consecutive slots at a
        # time (a prefix's pages are stored in order, so mostly one run): no copy between
        for start, stop in _runs([s if staged is None else None for s, staged in good]):
            slot, staged = good[start]
            data = staged[None] if staged is not None else self._slots[slot : slot + stop - start]
            self._scatter(torch.from_numpy(data), pages[start:stop])
        self.stats.loaded_pages += len(good)
        return len(good) * self.page_size

    def store(self, token_ids: list[int], namespace: Namespace, pages: list[int]) -> None:
        if self._closed or not pages:
            return
        num_pages = len(token_ids) // self.page_size
        keys = self.index.keys(token_ids, namespace, num_pages)[num_pages - len(pages) :]
        # NOTE: past the staging bound the writer is behind: the deeper pages are dropped
        # rather than waited for (a prefix's beginning is worth more than its end).
        fit = max(0, (self.max_pending_bytes - self._pending_bytes) // self.slot_bytes)
        self.stats.dropped_pages += sum(not self.index.holds(k) for k in keys[fit:])
        keys, pages = keys[:fit], pages[:fit]
        slots = self.index.reserve(keys)
        chosen = [(s, p) for s, p in zip(slots, pages, strict=True) if s is not None]
        self.stats.dropped_pages += sum(s is None and not self.index.holds(k) for s, k in zip(slots, keys, strict=True))
        if not chosen:
            return
        staged = self._gather([p for _, p in chosen]).numpy()
        with self.index.lock:
            for i, (slot, _) in enumerate(chosen):
                self._staged[slot] = staged[i]
            self._pending_bytes += staged.nbytes
        self.stats.stored_pages += len(chosen)
        self._queue.put(([s for s, _ in chosen], staged))

    @property
    def num_pages(self) -> int:
        return self.index.num_pages

    @property
    def num_bytes(self) -> int:
        return self.index.num_pages * self.slot_bytes

    def clear(self) -> int:
        return self.index.clear()

    def check_integrity(self) -> None:
        self.index.check_integrity()
        with self.index.lock:
            staged = set(self._staged)
        assert staged <= set(self.index.slots_by_age()), "staged bytes for a slot the tier dropped"

    def flush(self, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while self.index.num_pending:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=30)
        del self._slots
        with contextlib.suppress(BufferError):  # NOTE: a numpy view still alive: the mapping goes with it
            self._map.close()
        os.close(self._file)

    # ---- bytes ------------------------------------------------------------------------------
    def _views(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot-layout bytes [n, slot_bytes] as (codes [n, 2L, page bytes] uint8, scales
        [n, 2L, page_size * kv_heads] fp32); the same memory."""
        n, rows, scale_bytes = data.shape[0], self._rows, self._rows * self._scale_elems * 4
        codes = data[:, : self._code_bytes].view(n, rows, -1)
        scales = data[:, self._code_bytes : self._code_bytes + scale_bytes].view(torch.float32)
        return codes, scales.view(n, rows, self._scale_elems)

    def _gather(self, pages: list[int]) -> torch.Tensor:  # [len(pages), slot_bytes] uint8
        """The pages' K/V (and scales) out of the pool, in the slot layout."""
        out = torch.empty(len(pages), self.slot_bytes, dtype=torch.uint8)
        out[:, self._code_bytes + self._rows * self._scale_elems * 4 :] = 0  # the alignment padding
        codes, scales = self._views(out)
        index = torch.tensor(pages, dtype=torch.long)
        for row, (x, x_scale) in enumerate(self._pool_rows()):
            if self.int8:  # NOTE: a float pool: quantize its rows as the int8 pool would
                heads, dim = x.shape[1], x.shape[2]
                q, s = quantize_kv(x.view(-1, self.page_size * heads, dim).index_select(0, index).view(-1, heads, dim),
                                   torch.int8)
                codes[:, row] = q.view(len(pages), -1).view(torch.uint8)
                scales[:, row] = s.view(len(pages), -1)
                continue
            codes[:, row] = _page_bytes(x, self.page_size).index_select(0, index)
            if x_scale is not None:
                scales[:, row] = x_scale.view(-1, self._scale_elems).index_select(0, index)
        return out

    def _scatter(self, data: torch.Tensor, pages: list[int]) -> None:
        """Write slot-layout ``data`` [len(pages), slot_bytes] into the pool ``pages``."""
        n, ps = len(pages), self.page_size
        codes, scales = self._views(data)
        index = torch.tensor(pages, dtype=torch.long)
        for row, (x, x_scale) in enumerate(self._pool_rows()):
            if self.int8:
                heads, dim = x.shape[1], x.shape[2]
                values = dequantize_kv(codes[:, row].view(torch.int8).reshape(n * ps, heads, dim),
                                       scales[:, row].reshape(n * ps, heads))
                x.view(-1, ps * heads, dim).index_copy_(0, index, values.to(x.dtype).view(n, ps * heads, dim))
                continue
            _page_bytes(x, ps).index_copy_(0, index, codes[:, row])
            if x_scale is not None:
                x_scale.view(-1, self._scale_elems).index_copy_(0, index, scales[:, row])

    def _pool_rows(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(tensor, its scales) in slot row order: K of layer 0, V of layer 0, K of 1, ..."""
        rows: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for layer in range(self._rows // 2):
            k, v, k_scale, v_scale = self.kv.layer(layer)
            rows += [(k, k_scale), (v, v_scale)]
        return rows

    def _verified(self, slot: int) -> np.ndarray | bool:
        """``slot``'s staged bytes while its write is pending; else True if its bytes in
        the file pass their checksum, False if not."""
        with self.index.lock:
            staged = self._staged.get(slot)
        crc = self.index.checksum(slot)  # NOTE: after: the writer sets it before dropping the staging
        if staged is not None:
            return staged
        return crc is not None and zlib.crc32(self._slots[slot].data) == crc

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            slots, staged = item
            for i, slot in enumerate(slots):
                try:
                    self._slots[slot] = staged[i]
                    crc: int | None = zlib.crc32(staged[i].data)
                except (OSError, ValueError):  # NOTE: the mapping is preallocated; this is a disk fault
                    log.exception("KV tier write failed; the page is dropped")
                    crc = None
                self.index.written(slot, crc)  # NOTE: before the staging goes: a reader finds one of them
                with self.index.lock:
                    self._staged.pop(slot, None)
                    self._pending_bytes -= staged[i].nbytes


def _runs(slots: list[int | None]) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of ``slots`` holding consecutive slot numbers (a None
    stands alone)."""
    runs: list[tuple[int, int]] = []
    for i, slot in enumerate(slots):
        prev = slots[i - 1] if i else None
        if runs and slot is not None and prev is not None and slot == prev + 1:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _page_bytes(x: torch.Tensor, page_size: int) -> torch.Tensor:  # [num_pages, page bytes] uint8
    """A pool tensor [slots, kv_heads, head_dim] as one row of bytes per page, its own memory
    (a page's slots are consecutive); index ops copy bytes of any dtype, fp8 included."""
    return x.view(torch.uint8).view(x.shape[0] // page_size, -1)


def _open_file(directory: Path, size: int) -> tuple[int, mmap.mmap]:
    """A preallocated, already unlinked file of ``size`` bytes in ``directory``, mapped."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="arbor-kv-tier-", suffix=".bin", dir=directory)
    except OSError as exc:
        raise TierUnavailableError(exc.errno, f"cannot make the KV tier's file in {directory}: {exc.strerror}") from exc
    try:
        os.unlink(name)
        os.posix_fallocate(fd, 0, size)
        return fd, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        os.close(fd)
        raise TierUnavailableError(exc.errno, f"cannot allocate {size} bytes for the KV tier in "
                                   f"{directory}: {exc.strerror}") from exc


def make_tier(kv: KVCache, directory: str | None, max_bytes: int, int8: bool) -> KVTier:
    """The disk tier the settings ask for, or ``NoTier`` (none asked, or the file cannot be
    made: logged, and the engine serves without a tier)."""
    if directory is None:
        return NoTier()
    if kv.k[0].device.type != "cpu":
        log.warning("KV tier disabled: the disk tier is the CPU path's (the KV pool is on %s)", kv.k[0].device)
        return NoTier()
    try:
        return DiskTier(kv, directory, max_bytes, int8)
    except TierUnavailableError as exc:
        log.warning("KV tier disabled: %s", exc)
        return NoTier()
