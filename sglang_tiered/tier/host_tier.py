"""Glue between a device KV pool (this TP rank's heads) and the shared canonical ``HostPool``.

``demote`` copies whole device pages (all layers, K and V, this rank's heads) into host slots;
``load`` copies host slots into freshly allocated device pages. Both move every page of a batch,
every (K|V, layer) plane, in one launch (``move_pages_all``). A failed copy leaves nothing
published: ``demote`` commits the host index only after every plane is written, and ``load``
reports failure so the caller frees the device pages and treats the request as a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from sglang_tiered.kernels.kv_pages import PoolPlanes, move_pages_all
from sglang_tiered.tier.host_pool import HostPool, HostPoolError, PoolLayout, heads_for_rank

logger = logging.getLogger("sglang_tiered")

# What a demotion copies (``HostTier.demote``): a device victim, a write-through copy of pages
# still on the device (admitted), or a write-ahead copy of pages the device is about to evict.
VICTIM, THROUGH, AHEAD = "victim", "through", "ahead"


@dataclass
class HostTierStats:
    demoted_pages: int = 0
    demote_skipped_pages: int = 0
    promoted_pages: int = 0
    failed_promotions: int = 0
    failed_demotions: int = 0
    foreign_slots: int = 0  # promotions refused because a slot held another page than indexed
    host_evicted_pages: int = 0
    demote_seconds: float = 0.0
    promote_seconds: float = 0.0


class HostTier:
    def __init__(self, pool: HostPool, k_buffers, v_buffers, *, page_size: int, total_kv_heads: int,
                 tp_size: int, tp_rank: int, layer_offset: int = 0, stream_fence=None):  # fmt: skip
        self.pool = pool
        self.k_buffers = k_buffers
        self.v_buffers = v_buffers
        self.page_size = page_size
        self.heads = heads_for_rank(total_kv_heads, tp_size, tp_rank)
        if len(self.heads) != k_buffers[0].shape[1]:
            raise ValueError(f"rank {tp_rank} holds {k_buffers[0].shape[1]} KV heads, expected {len(self.heads)}")
        # where this rank's heads sit in the pool: the canonical layout holds every KV head (a
        # named T1, or TP 1); a rank's private T1 holds its own heads only
        if pool.layout.kv_heads == total_kv_heads:
            self.h0 = self.heads.start
        elif pool.layout.kv_heads == len(self.heads):
            self.h0 = 0
        else:
            raise ValueError(f"T1 holds {pool.layout.kv_heads} KV heads: neither all {total_kv_heads} nor rank "
                             f"{tp_rank}'s {len(self.heads)}")  # fmt: skip
        pool.own_heads = slice(self.h0, self.h0 + len(self.heads))
        self.layer_offset = layer_offset
        self.stream_fence = stream_fence  # callable: order copies after the forward stream (CUDA)
        self.forward_stream = None  # CUDA: the model runner's forward stream (integration/host_setup.py)
        self.stats = HostTierStats()
        # The store queue's worker demotes while the scheduler promotes, probes and invalidates:
        # every change to the pool's index and every copy runs under this lock.
        self.lock = threading.RLock()
        # TP > 1: ``agree(ok) -> bool``, True only when every rank's transfer succeeded (an
        # all-reduce MIN over the TP group, integration/host_setup.py). Each rank keeps its own T1
        # and tree and they stay equal only by reaching equal results: a copy that failed on one
        # rank alone left that rank's T1 without pages the others committed, the ranks then
        # probed different T1 hits and prefilled different lengths, with mismatched collectives
        # (review, session 23). Every transfer's outcome is agreed, and a failure anywhere is a
        # failure everywhere (a skipped demotion, a clean miss). None: one rank.
        self.agree = None
        self.decision = "on"
        # When T1 is full: True replaces its least recently used pages (a victim cache); False
        # skips the demotion (counted in demote_skipped_pages).
        self.replace_when_full = True
        self.t2 = None  # T2Tier behind this T1 (sglang_tiered/tier/t2.py), fed by T1's victims
        self.kv = None  # SGLang's KV pool object, when built from one (build): its lists are re-read
        # the device pool's plane addresses; built now, so a pool T1 cannot move (V planes shaped
        # unlike K: review, session 22) turns T1 off at start-up instead of failing every transfer
        self._planes = PoolPlanes(k_buffers, v_buffers)

    @classmethod
    def build(cls, kvcache, *, page_size: int, total_kv_heads: int, tp_size: int, tp_rank: int,
              capacity_pages: int, name: str | None, stream_fence=None,
              staging_pages: int = 0) -> "HostTier":  # fmt: skip
        """``staging_pages``: slots beyond ``capacity_pages`` for the store queue's write-ahead
        copies (``HostPool.reserve_staging``).

        Without a ``name`` and with TP > 1 every rank keeps a private T1 of its own heads (the
        ranks decide alike, so their T1s hold the same pages; nothing is shared that one rank
        could change under another). A named T1 is one file for every rank, in the canonical
        layout of all heads; ranks that replicate a KV head (TP > KV heads) cannot share it (two
        writers of the same bytes out of step) and are refused."""
        k0 = kvcache.k_buffer[0]
        dtype = str(k0.dtype).replace("torch.", "")
        heads = heads_for_rank(total_kv_heads, tp_size, tp_rank)
        if name and tp_size > total_kv_heads:
            raise HostPoolError(f"a named T1 cannot be shared by TP {tp_size} ranks that replicate {total_kv_heads} "
                                "KV heads (two writers of the same bytes); unset SGLANG_TIERED_HOST_NAME "
                                "for a private T1 per rank")  # fmt: skip
        pool_heads = total_kv_heads if (name or tp_size == 1) else len(heads)
        layout = PoolLayout(capacity_pages + staging_pages, len(kvcache.k_buffer), pool_heads, page_size,
                            k0.shape[2], dtype)  # fmt: skip
        pool = HostPool(layout, name=name, pin_memory=k0.is_cuda, staging=staging_pages)
        if k0.is_cuda and not pool.raw.is_pinned():  # a named (shared-memory) T1: register it
            from sglang_tiered.kernels.kv_pages import pin_host_memory, unpin_host_memory

            if pin_host_memory(pool.raw):
                import atexit

                atexit.register(unpin_host_memory, pool.raw)
            else:
                logger.warning("sglang-tiered: could not pin T1 (cudaHostRegister); copies go through staging")
        tier = cls(pool, kvcache.k_buffer, kvcache.v_buffer, page_size=page_size,
                   total_kv_heads=total_kv_heads, tp_size=tp_size, tp_rank=tp_rank,
                   stream_fence=stream_fence)  # fmt: skip
        tier.kv = kvcache
        if k0.is_cuda:
            tier.warm_up()
        return tier

    def warm_up(self) -> None:
        """Compile and load the page movers now, at start-up: compiled lazily, the first transfer
        took 1.25 s (measured on an H200, empty Triton cache) under ``lock`` with the scheduler
        waiting, and SGLang can refuse kernels loaded after the server is ready
        (``SGLANG_CRASH_ON_TRITON_LOAD_AFTER_READY``). Each direction moves one page through
        SGLang's padding page 0 (never allocated to a request) and, to T1, into a free slot that
        no index entry names (skipped when T1 has none)."""
        kb = self.k_buffers[0]
        zero = torch.zeros(1, dtype=torch.int64, device=kb.device)
        with self.lock:
            free = self.pool.free
            if free:
                slot = self._host_ids([free[-1]])
                self._move(zero, slot, to_host=True)
            self._move(zero, self._host_ids([0]), to_host=False)

    def _fence(self) -> None:
        if self.stream_fence is not None:
            self.stream_fence()

    def demote(self, device_pages: torch.Tensor, hashes: list[bytes], tenant: int = 0, ready=None,
               kind: str = VICTIM) -> int:  # fmt: skip
        """Copy device pages to T1 (skipping pages already there). Returns pages copied.
        ``ready``: CUDA events the copy waits for (the forward passes that wrote the pages).
        ``kind``:
        - VICTIM: pages the device evicts; copies of them written earlier (THROUGH, AHEAD) are
          adopted, not copied again (``HostPool.reserve``).
        - THROUGH: a copy of pages still on the device: only into free room, and at the least
          recently used end, so it never pushes out a page only T1 holds and is the first to go
          when one needs room.
        - AHEAD: a copy of pages the device is about to evict, into the staging slots outside
          T1's capacity.
        So T1's pages, and their order, are those of a store that copies every victim at eviction
        (``tests/test_tier.py``)."""
        with self.lock:
            return self._demote(device_pages, hashes, tenant, ready, kind)

    def touch(self, hashes: list[bytes]) -> bool:
        """Mark resident pages as just used. True when every page is resident."""
        with self.lock:
            pool = self.pool
            if not all(pool.contains(h) for h in hashes):
                return False
            pool.slots_for(hashes, touch=True)
            return True

    def clear(self) -> int:
        with self.lock:
            return self.pool.clear()

    def tenant_pages(self) -> dict:
        with self.lock:
            return self.pool.tenant_pages()

    def _demote(self, device_pages, hashes, tenant, ready, kind=VICTIM) -> int:
        t0 = time.perf_counter()
        pool = self.pool
        if kind == AHEAD:
            pairs = pool.reserve_staging(hashes)
        else:
            pairs = pool.reserve(hashes, evict=self.replace_when_full and kind == VICTIM, touch=kind == VICTIM)
        if kind == VICTIM:  # (a copy of a page still on the device is not a lost victim)
            wanted = sum(1 for h in hashes if not pool.contains(h))
            self.stats.demote_skipped_pages += max(0, wanted - len(pairs))
        if not pairs:
            pool.commit(pairs)  # (orders the pages reserve adopted)
            if self.t2 is not None:
                self.t2.flush()  # (adopting may have pushed victims out)
            return 0
        pos = {h: i for i, h in enumerate(hashes)}
        src = device_pages[[pos[h] for h, _ in pairs]].to(torch.int64)
        dst_list = [s for _, s in pairs]
        dst = self._host_ids(dst_list)
        pool.begin_write([s for _, s in pairs])
        try:
            if ready is not None:
                for ev in ready:
                    torch.cuda.current_stream().wait_event(ev)
            else:
                self._fence()
            self._check_ids(src.tolist(), dst_list, to_host=True)
            self._move(src, dst, to_host=True)
            ok = True
        except Exception:  # noqa: BLE001 - a failed transfer is a skipped demotion, never partial
            ok = False
            logger.exception("sglang-tiered: demotion of %d pages failed; skipped", len(pairs))
        if self.agree is not None and not self.agree(ok):  # another rank's copy failed: skipped here too
            ok = False
        if not ok:
            pool.abort(pairs)
            if self.t2 is not None:
                self.t2.flush()
            self.stats.failed_demotions += len(pairs)
            return 0
        pool.commit(pairs, tenant, cold=kind == THROUGH, staged=kind == AHEAD)
        if self.t2 is not None:
            self.t2.flush()  # the victims reserve() copied out go to T2's store queue
        if kind != AHEAD:  # (staged pages count when an eviction adopts them)
            self.stats.demoted_pages += len(pairs)
        self.stats.demote_seconds += time.perf_counter() - t0
        return len(pairs)

    def load(self, hashes: list[bytes], device_pages: torch.Tensor) -> bool:
        """Copy T1 pages into the given device pages. All or nothing: False means use none."""
        with self.lock:
            ok = self._load(hashes, device_pages)
            if self.agree is not None and not self.agree(ok) and ok:  # failed on another rank
                self.stats.failed_promotions += 1
                ok = False
            return ok

    def _load(self, hashes, device_pages) -> bool:
        t0 = time.perf_counter()
        if any(not self.pool.contains(h) for h in hashes):
            self.stats.failed_promotions += 1
            return False
        slot_list = self.pool.slots_for(hashes)
        if not self.pool.verify(hashes, slot_list):
            return self._foreign_slots(len(hashes))
        slots = self._host_ids(slot_list)
        pages = device_pages.to(torch.int64)
        try:
            self._fence()
            self._check_ids(pages.tolist(), slot_list, to_host=False)
            self._move(pages, slots, to_host=False)
        except Exception:  # noqa: BLE001
            self.stats.failed_promotions += 1
            logger.exception("sglang-tiered: promotion of %d pages failed; recomputing", len(hashes))
            return False
        if not self.pool.verify(hashes, slot_list):  # overwritten while we copied
            return self._foreign_slots(len(hashes))
        self.stats.promoted_pages += len(hashes)
        self.stats.promote_seconds += time.perf_counter() - t0
        return True

    def _check_ids(self, pages: list, slots: list, *, to_host: bool) -> None:
        """Before a transfer: every device page and T1 slot in range, and the side written has no
        duplicate. The kernels do not check bounds (a page id one past a plane writes into the
        next plane: review, session 22), so a bad id must fail here, as a clean miss."""
        n_dev = self.k_buffers[0].shape[0] // self.page_size
        n_host = self.pool.layout.num_pages
        if pages and (min(pages) < 0 or max(pages) >= n_dev):
            raise ValueError(f"device page ids outside [0, {n_dev})")
        if slots and (min(slots) < 0 or max(slots) >= n_host):
            raise ValueError(f"T1 slots outside [0, {n_host})")
        written = slots if to_host else pages
        if len(set(written)) != len(written):
            raise ValueError(f"duplicate {'T1 slots' if to_host else 'device pages'} in a transfer")

    def _move(self, pages: torch.Tensor, slots: torch.Tensor, *, to_host: bool) -> None:
        """Every (K|V, layer) plane of a transfer between device ``pages`` and T1 ``slots``
        (unique, checked by the caller): one launch on CUDA (``move_pages_all``), then wait for
        it on this stream, so the copy is complete when this returns."""
        if self.kv is not None:  # SGLang replaces the lists when it reallocates (memory_pool.py)
            self.k_buffers, self.v_buffers = self.kv.k_buffer, self.kv.v_buffer
        kb = self.k_buffers[0]
        if not self._planes.current(self.k_buffers, self.v_buffers):
            self._planes = PoolPlanes(self.k_buffers, self.v_buffers)
        move_pages_all(self._planes, self.pool.data, pages.to(kb.device), slots, self.h0, self.page_size,
                       to_host=to_host, unique_checked=True)  # fmt: skip
        if kb.is_cuda:
            torch.cuda.current_stream(kb.device).synchronize()

    def _foreign_slots(self, n: int) -> bool:
        """A slot no longer holds the page this process indexed (another writer, or a corrupted
        index): a clean miss, counted and logged once."""
        self.stats.failed_promotions += 1
        self.stats.foreign_slots += 1
        if self.stats.foreign_slots == 1:
            logger.warning("sglang-tiered: T1 slots hold other pages than indexed (another writer?); "
                           "treating %d pages as a miss", n)  # fmt: skip
        return False

    def _host_ids(self, slots: list) -> torch.Tensor:
        """Slot ids for the page movers: on the device when T1 is pinned and the pool is on CUDA
        (the Triton kernels then read and write T1 directly), in host memory otherwise."""
        ids = torch.tensor(slots, dtype=torch.int64)
        kb = self.k_buffers[0]
        if kb.is_cuda and self.pool.data.is_pinned():
            ids = ids.to(kb.device)
        return ids

    def fetch_t2(self, hashes: list[bytes], tenant: int) -> int:
        """Bring the leading run of ``hashes`` that T2 holds into T1 (0 without T2)."""
        if self.t2 is None:
            return 0
        return self.t2.fetch(hashes, tenant)

    def drop_tenant(self, tenant: int) -> int:
        with self.lock:
            return self.pool.drop_slots(self.pool.slots_of_tenant(tenant))

    def snapshot(self) -> dict:
        p = self.pool
        return {
            "name": "host",
            "enabled": True,
            "capacity_pages": p.capacity,
            "resident_pages": p.resident,
            "staging_pages": p.staging,
            "staged_pages": len(p.staged),
            "staged_used_pages": p.staged_used,
            "staged_dropped_pages": p.staged_dropped,
            "capacity_bytes": p.layout.data_bytes,
            "resident_bytes": p.resident * p.layout.page_bytes,
            "demotions": self.stats.demoted_pages + p.staged_used,
            "promotions": self.stats.promoted_pages,
            "demote_skipped_pages": self.stats.demote_skipped_pages,
            "failed_promotions": self.stats.failed_promotions,
            "failed_demotions": self.stats.failed_demotions,
            "foreign_slots": self.stats.foreign_slots,
            "promote_ms": round(self.stats.promote_seconds * 1e3, 3),
            "demote_ms": round(self.stats.demote_seconds * 1e3, 3),
            "decision": self.decision,
        }
