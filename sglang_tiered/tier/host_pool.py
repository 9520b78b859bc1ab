"""T1 host pool: KV pages in the canonical, TP-independent layout ``[kv][layer][kv_head][page][token][dim]``.

* One copy per server: a named shared-memory file (``/dev/shm/sglang-tiered-<name>``) that every TP
  rank of the server maps; rank r reads and writes only the KV heads SGLang gives it (contiguous
  ranges, ``heads_for_rank``). The file outlives the server, so a restart, also at another TP
  degree, finds the pages again (warm restart). Without a name the pool is private memory.
* The index (page hash -> slot) lives in the same file: a 16-byte hash and a valid byte per slot.
  Every rank runs the same tree and reaches the same decisions, so each keeps an identical dict
  and writes identical index entries; data is written before the valid byte.
* Page identity is the chained page hash (sglang_tiered/core/keys.py), which includes the exact
  weights digest, KV dtype and RoPE config: a restart with other weights finds nothing.
* Accounting: ``free + resident == capacity`` always (``check_invariants``).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from collections import OrderedDict
from dataclasses import asdict, dataclass

import torch

logger = logging.getLogger("sglang_tiered")
HASH_BYTES = 16
SHM_DIR = pathlib.Path(os.environ.get("SGLANG_TIERED_SHM_DIR", "/dev/shm"))
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class PoolLayout:
    num_pages: int
    layers: int
    kv_heads: int
    page_size: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"; fp8 pools are stored as "uint8"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page for all layers and all KV heads (K and V)."""
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.page_size * self.head_dim * elem

    @property
    def data_bytes(self) -> int:
        return self.page_bytes * self.num_pages


def heads_for_rank(total_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """KV heads SGLang gives attention-TP rank ``tp_rank`` (sglang/srt/layers/linear.py:1140-1145,
    1499-1503 in 0.5.23): contiguous ranges; when tp_size > heads, each head is replicated on
    tp_size / heads consecutive ranks."""
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise ValueError(f"{total_kv_heads} KV heads do not split over TP {tp_size}")
        per = total_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % total_kv_heads:
        raise ValueError(f"TP {tp_size} is not a multiple of {total_kv_heads} KV heads")
    replicas = tp_size // total_kv_heads
    h = tp_rank // replicas
    return range(h, h + 1)


class HostPoolError(RuntimeError):
    pass


class HostPool:
    def __init__(self, layout: PoolLayout, *, name: str | None = None, pin_memory: bool = False):
        self.layout = layout
        self.name = name
        L, H, P, ps, D = layout.layers, layout.kv_heads, layout.num_pages, layout.page_size, layout.head_dim
        elem = torch.empty((), dtype=layout.torch_dtype).element_size()
        index_bytes = P * (HASH_BYTES + 1)
        total = layout.data_bytes + index_bytes
        self.attached = False
        if name:
            path = SHM_DIR / f"sglang-tiered-{name}"
            meta_path = path.with_suffix(".json")
            meta = {"version": LAYOUT_VERSION, **asdict(layout)}
            if path.exists() and meta_path.exists():
                try:
                    old = json.loads(meta_path.read_text())
                except ValueError:
                    old = None
                if old == meta and path.stat().st_size == total:
                    self.attached = True
                else:
                    logger.warning("sglang-tiered: T1 file %s has another layout; recreating it", path)
                    path.unlink(missing_ok=True)
            try:
                storage = torch.UntypedStorage.from_file(str(path), True, total)
            except (OSError, RuntimeError) as exc:
                raise HostPoolError(f"cannot map T1 shared memory {path} ({total} bytes): {exc}") from exc
            if not self.attached:
                meta_path.write_text(json.dumps(meta))
            self.path = path
            raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        else:
            self.path = None
            try:
                raw = torch.zeros(total, dtype=torch.uint8, pin_memory=pin_memory)
            except RuntimeError as exc:
                raise HostPoolError(f"cannot allocate {total} bytes of host memory for T1: {exc}") from exc
        self.raw = raw
        data = raw[: layout.data_bytes].view(layout.torch_dtype)
        self.data = data.view(2, L, H, P, ps, D)
        self.index_hashes = raw[layout.data_bytes : layout.data_bytes + P * HASH_BYTES].view(P, HASH_BYTES)
        self.index_valid = raw[layout.data_bytes + P * HASH_BYTES : total]
        self.slot_of: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # resident slots, least recent first
        self.free: list[int] = []
        self._load_index()
        del elem

    # ------------------------------------------------------------------ index
    def _load_index(self) -> None:
        P = self.layout.num_pages
        valid = self.index_valid.tolist() if self.attached else [0] * P
        if not self.attached:
            self.index_valid.zero_()
        hashes = self.index_hashes.numpy() if self.attached else None
        for slot in range(P):
            if valid[slot]:
                h = bytes(hashes[slot])
                if h in self.slot_of:  # duplicate entry: keep the first
                    self.index_valid[slot] = 0
                    self.free.append(slot)
                    continue
                self.slot_of[h] = slot
                self.lru[slot] = None
            else:
                self.free.append(slot)
        self.free.reverse()  # pop() hands out low slots first

    @property
    def capacity(self) -> int:
        return self.layout.num_pages

    @property
    def resident(self) -> int:
        return len(self.slot_of)

    def contains(self, h: bytes) -> bool:
        return h in self.slot_of

    def leading_hits(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.slot_of:
                break
            n += 1
        return n

    def slots_for(self, hashes: list[bytes], touch: bool = True) -> list[int]:
        slots = [self.slot_of[h] for h in hashes]
        if touch:
            for s in slots:
                self.lru.move_to_end(s)
        return slots

    def reserve(self, hashes: list[bytes], *, evict: bool = True) -> list[tuple[bytes, int]]:
        """Slots for pages not yet resident (least recently used pages make room when ``evict``).
        Returns (hash, slot) pairs in order; fewer than asked when the pool is full."""
        out = []
        for h in hashes:
            if h in self.slot_of:
                continue
            if not self.free:
                if not evict or not self.lru:
                    break
                victim, _ = self.lru.popitem(last=False)
                self._forget(victim)
            slot = self.free.pop()
            out.append((h, slot))
        return out

    def commit(self, pairs: list[tuple[bytes, int]]) -> None:
        """Publish slots whose data has been written."""
        for h, slot in pairs:
            self.index_hashes[slot] = torch.frombuffer(bytearray(h), dtype=torch.uint8)
            self.index_valid[slot] = 1
            self.slot_of[h] = slot
            self.lru[slot] = None

    def abort(self, pairs: list[tuple[bytes, int]]) -> None:
        for _, slot in pairs:
            self.free.append(slot)

    def _forget(self, slot: int) -> None:
        h = bytes(self.index_hashes[slot].numpy())
        self.index_valid[slot] = 0
        if self.slot_of.get(h) == slot:
            del self.slot_of[h]
        self.free.append(slot)

    def drop(self, hashes) -> int:
        n = 0
        for h in list(hashes):
            slot = self.slot_of.get(h)
            if slot is not None:
                self.lru.pop(slot, None)
                self._forget(slot)
                n += 1
        return n

    def clear(self) -> int:
        n = self.resident
        for slot in list(self.lru):
            self._forget(slot)
        self.lru.clear()
        return n

    def check_invariants(self) -> None:
        assert len(self.free) + self.resident == self.capacity, (len(self.free), self.resident)
        assert len(self.lru) == self.resident
        assert len(set(self.free)) == len(self.free)
        assert not set(self.free) & set(self.slot_of.values())

    def close(self, unlink: bool = False) -> None:
        if unlink and self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path.with_suffix(".json").unlink(missing_ok=True)
