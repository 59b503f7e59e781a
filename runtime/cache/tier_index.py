"""A KV tier's bookkeeping: page keys, slots, LRU order, locks and checksums (torch-free).

Keys, as LMCache keys its chunks: page ``i`` of a sequence is keyed by a digest of its
namespace and *every* token up to the end of page ``i``, so one key names a whole prefix
and a match is a run of consecutive keys, each found only if the tier holds it::

    tokens   [ t0 .. t15 | t16 .. t31 | t32 .. t47 ]      page_size = 16
    keys       k0 = H(ns, t0..t15)
                         k1 = H(ns, t0..t31)
                                      k2 = H(ns, t0..t47)

(one running blake2b over the tokens: a key costs one ``update`` and one ``digest``).

Slots are the medium's fixed-size cells (one page each); every slot is either free or
holds exactly one key. LRU order is kept so that a prefix is never older than what
extends it (a store inserts the deepest page first; a match touches the deepest first):
the tier evicts the ends of sequences before their beginnings, so what it keeps stays
reachable. A slot is skipped by eviction while locked (a match between admission and
load) or pending (its background write has not finished; ``written`` ends it and records
the data's checksum, which a load verifies).

The engine thread calls everything but ``written`` (the writer thread); ``lock`` guards the
state the two share.
"""

from __future__ import annotations

import hashlib
import heapq
import threading
from array import array
from collections import Counter, OrderedDict

from runtime.cache.namespace import Namespace

KEY_BYTES = 16  # blake2b digest size: a collision would reload another prefix's KV


class TierIndex:
    """Args:
        num_slots: the medium's cells (pages it can hold).
        page_size: tokens per page.
    """

    def __init__(self, num_slots: int, page_size: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a tier needs at least one slot, got {num_slots}")
        self.num_slots, self.page_size = num_slots, page_size
        self.lock = threading.Lock()
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, oldest first
        self._key_of: dict[int, bytes] = {}  # slot -> key
        self._free: list[int] = list(range(num_slots))  # a heap: lowest slot first
        self._locks: Counter[int] = Counter()
        self._pending: set[int] = set()  # slots whose write has not finished
        self._crc: dict[int, int] = {}  # slot -> checksum of its data, once written

    # ---- keys -----------------------------------------------------------------------------
    def keys(self, token_ids: list[int], namespace: Namespace, num_pages: int) -> list[bytes]:
        """The keys of the first ``num_pages`` pages of ``token_ids``."""
        ps = self.page_size
        data = array("q", token_ids[: num_pages * ps]).tobytes()
        step = ps * 8  # NOTE: "q" is 8 bytes per token id
        h = hashlib.blake2b(b"" if namespace is None else namespace.encode(), digest_size=KEY_BYTES)
        h.update(b"\x00")  # NOTE: ends the namespace, so its bytes never read as token bytes
        out = []
        for i in range(num_pages):
            h.update(data[i * step : (i + 1) * step])
            out.append(h.digest())
        return out

    # ---- lookup ---------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> list[int]:
        """Slots of the longest run of ``keys`` (from the first) the tier holds; touched."""
        with self.lock:
            slots = []
            for key in keys:
                slot = self._lru.get(key)
                if slot is None:
                    break
                slots.append(slot)
            for key in reversed(keys[: len(slots)]):  # NOTE: deepest first: the prefix ends newest
                self._lru.move_to_end(key)
            return slots

    def holds(self, key: bytes) -> bool:
        return key in self._lru

    # ---- storing --------------------------------------------------------------------------
    def reserve(self, keys: list[bytes]) -> list[int | None]:
        """A slot for each of ``keys`` the tier lacks (marked pending: the caller writes
        it, then calls ``written``); None for a key already held (touched) or one no slot
        could be found for (every other slot locked or pending)."""
        out: list[int | None] = [None] * len(keys)
        with self.lock:
            for i, key in enumerate(keys):
                if key in self._lru:
                    continue
                slot = self._take_slot()
                if slot is None:
                    continue
                self._lru[key] = slot
                self._key_of[slot] = key
                self._pending.add(slot)
                out[i] = slot
            for key in reversed(keys):  # NOTE: deepest first: the prefix ends newest
                if key in self._lru:
                    self._lru.move_to_end(key)
        return out

    def _take_slot(self) -> int | None:
        if self._free:
            return heapq.heappop(self._free)
        for key, slot in self._lru.items():  # oldest first
            if not self._locks[slot] and slot not in self._pending:
                self._remove(key, slot)
                return slot
        return None

    def written(self, slot: int, crc: int | None) -> None:
        """The writer finished ``slot``: its data has checksum ``crc`` (None: the write
        failed, and the slot is dropped)."""
        with self.lock:
            self._pending.discard(slot)
            if crc is None:
                key = self._key_of.get(slot)
                if key is not None:
                    self._remove(key, slot)
                    heapq.heappush(self._free, slot)
            else:
                self._crc[slot] = crc

    def is_pending(self, slot: int) -> bool:
        with self.lock:
            return slot in self._pending

    def checksum(self, slot: int) -> int | None:
        with self.lock:
            return self._crc.get(slot)

    # ---- locks and removal ----------------------------------------------------------------
    def lock_slots(self, slots: tuple[int, ...]) -> None:
        with self.lock:
            for slot in slots:
                self._locks[slot] += 1

    def unlock_slots(self, slots: tuple[int, ...]) -> None:
        with self.lock:
            for slot in slots:
                assert self._locks[slot] > 0, "tier unlock without lock"
                self._locks[slot] -= 1
                if not self._locks[slot]:
                    del self._locks[slot]

    def drop(self, slot: int) -> None:
        """Forget ``slot``'s page (it failed its checksum); the slot is free again."""
        with self.lock:
            key = self._key_of.get(slot)
            if key is not None and slot not in self._pending:
                self._remove(key, slot)
                heapq.heappush(self._free, slot)

    def clear(self) -> int:
        """Drop every page that is neither locked nor pending; returns how many."""
        with self.lock:
            victims = [(k, s) for k, s in self._lru.items() if not self._locks[s] and s not in self._pending]
            for key, slot in victims:
                self._remove(key, slot)
                heapq.heappush(self._free, slot)
            return len(victims)

    def _remove(self, key: bytes, slot: int) -> None:
        del self._lru[key]
        del self._key_of[slot]
        self._crc.pop(slot, None)

    # ---- accounting -----------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self._lru)

    @property
    def num_pending(self) -> int:
        with self.lock:
            return len(self._pending)

    def slots_by_age(self) -> list[int]:
        """Held slots, least recently used first (for tests)."""
        with self.lock:
            return list(self._lru.values())

    def check_integrity(self, idle: bool = True) -> None:
        """Every slot free or held by one key; checksums for written slots; with ``idle``
        (no admission in progress) no lock is held."""
        with self.lock:
            held = list(self._lru.values())
            assert len(held) == len(set(held)), "a tier slot holds two keys"
            assert {s: k for k, s in self._lru.items()} == self._key_of, "tier slot map drifted"
            assert not set(held) & set(self._free), "a tier slot is both free and held"
            assert len(held) + len(self._free) == self.num_slots, "tier slots leaked"
            assert self._pending <= set(held), "a pending write for a slot no key holds"
            assert set(self._crc) == set(held) - self._pending, "a written tier slot has no checksum"
            assert all(n > 0 for n in self._locks.values()), "a tier lock count went to zero and stayed"
            if idle:
                assert not self._locks, f"tier slots locked while idle: {dict(self._locks)}"
