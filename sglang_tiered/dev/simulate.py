"""Drive a real SGLang radix cache without a model: a page allocator, a req_to_token pool and
requests, in the scheduler's call order (match, lock, allocate with eviction, checkpoint, free the
unadopted tail, unlock), exactly as ``release_kv_cache`` (sglang/srt/mem_cache/common.py:400-444)
does it. Used by ``TieredRadixCache.create_simulated``, the trace benchmark and property tests.
By default a request finishes at its prefill (``max_new_tokens`` 1); given its ``output_ids`` it
decodes as a live server's does (``CacheDriver.decode``), which replays a live server's
per-request hits exactly (tests/test_review40_live_fidelity.py, bench/live_fidelity.py).
"""

from __future__ import annotations

import hashlib

import time
from array import array
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from sglang.srt.managers.schedule_batch import ReqKvInfo
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey


class SimPageAllocator:
    """Page-granular token slot allocator with the parts of SGLang's allocator API the tree uses."""

    def __init__(self, capacity_tokens: int, page_size: int, kv: "SimKVCache | None" = None):
        if capacity_tokens < page_size:
            raise ValueError("capacity_tokens must hold at least one page")
        self._kv = kv
        self.page_size = page_size
        self.num_pages = capacity_tokens // page_size
        self.size = self.num_pages * page_size
        self.device = torch.device("cpu")
        # Page 0 is padding in SGLang's pools; keep that convention so slot 0 is never handed out.
        self.free_pages: list[int] = list(range(self.num_pages, 0, -1))
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def get_kvcache(self):
        return self._kv

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        n_pages = -(-num_tokens // self.page_size)
        if n_pages > len(self.free_pages):
            return None
        pages = torch.tensor([self.free_pages.pop() for _ in range(n_pages)], dtype=torch.int64)
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)[:num_tokens]

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel() == 0:
            return
        pages = torch.unique(indices // self.page_size).tolist()
        self.free_pages.extend(pages)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        assert start_pos % self.page_size == 0, f"segment start {start_pos} is not page-aligned"
        self.free(free_index)


class SimKVCache:
    """Small real K/V buffers in SGLang's NHD layout (``k_buffer[layer][slot, head, dim]``), so the
    host tier can move real bytes in simulation and tests can check what a hit serves."""

    def __init__(self, size: int, page_size: int, layers: int = 2, heads: int = 2, head_dim: int = 4):
        shape = (size + page_size, heads, head_dim)
        self.k_buffer = [torch.zeros(shape) for _ in range(layers)]
        self.v_buffer = [torch.zeros(shape) for _ in range(layers)]
        self.head_num, self.head_dim, self.layer_num = heads, head_dim, layers


def expected_kv(token_ids, tenant, layers: int, heads: int, head_dim: int) -> torch.Tensor:
    """What "recomputation" produces for each position: a value that depends on the tenant and the
    whole prefix up to that position (causal), per layer/head/dim. Shape [n, layers, 2, heads, dim].
    ``tenant`` is the namespace: a salt, or (salt, extra_key) as a LoRA adapter would be; distinct
    namespaces give distinct values (a stable hash), so serving one's KV to another is caught."""
    ns = tenant if isinstance(tenant, tuple) else (tenant or None, None)
    if ns[1] is None:
        ns = (ns[0] or None,)
    digest = hashlib.blake2b(repr(ns).encode(), digest_size=4).digest()
    acc = int.from_bytes(digest, "little") % 997
    vals = []
    for t in token_ids:
        acc = (acc * 31 + int(t) + 7) % (1 << 20)
        vals.append(acc)
    base = torch.tensor(vals, dtype=torch.float32)[:, None, None, None, None]
    offs = (torch.arange(layers)[:, None, None, None] * 0.25 + torch.arange(2)[None, :, None, None] * 0.5
            + torch.arange(heads)[None, None, :, None] * 0.125 + torch.arange(head_dim) * 0.0625)
    return base + offs


class SimReqToTokenPool:
    def __init__(self, max_reqs: int, max_len: int):
        self.req_to_token = torch.zeros((max_reqs, max_len), dtype=torch.int64)
        self.free_rows = list(range(max_reqs - 1, -1, -1))

    def alloc_row(self) -> int:
        if not self.free_rows:  # more requests in flight than rows (ConcurrentReplay): grow
            n = self.req_to_token.shape[0]
            self.req_to_token = torch.cat([self.req_to_token, torch.zeros_like(self.req_to_token)])
            self.free_rows = list(range(2 * n - 1, n - 1, -1))
        return self.free_rows.pop()

    def free_row(self, row: int) -> None:
        self.free_rows.append(row)

    def write(self, indices, values) -> None:
        self.req_to_token[indices] = values


class SimReq:
    """The fields of ``sglang.srt.managers.schedule_batch.Req`` that the tree cache reads."""

    def __init__(self, rid: str, token_ids, *, cache_salt=None, extra_key=None, no_store=False):
        ids = token_ids if isinstance(token_ids, array) else array("q", token_ids)
        self.rid = rid
        self.origin_input_ids = ids
        self.full_untruncated_fill_ids = ids
        self.cache_salt = cache_salt or None
        self.extra_key = extra_key
        self.priority = None
        self.kv = ReqKvInfo()
        self.lock = None
        self.last_node = None
        self.skip_radix_cache_insert = False
        self.no_store = no_store

    def finished(self) -> bool:
        return True


@dataclass
class InFlight:
    """A request between ``CacheDriver.begin`` and ``CacheDriver.end``."""

    req: SimReq
    row: int
    n: int
    prefix_len: int
    seconds: float
    kv_len: int = 0  # tokens whose KV the request holds (0: its prompt; more once it decoded)


@dataclass
class RequestOutcome:
    prompt_len: int
    cached_len: int
    seconds: float  # time spent in cache calls for this request
    served: bool = True


class CacheDriver:
    """Runs requests one at a time through a tree cache in the scheduler's call order."""

    def __init__(self, cache, allocator: SimPageAllocator, req_pool: SimReqToTokenPool, verify_kv=False):
        self.cache = cache
        self.allocator = allocator
        self.req_pool = req_pool
        self.verify_kv = verify_kv and allocator.get_kvcache() is not None
        self._n = 0
        self.host_loaded_tokens = 0

    def run(self, token_ids, *, tenant=None, no_store=False, extra_key=None, during=None,
            max_prefix_len=None, output_ids=None) -> RequestOutcome:  # fmt: skip
        """One request, start to end. ``during``: called where the forward pass runs (after the
        request's KV is computed, before its checkpoint), e.g. a weight update or an invalidation
        that arrives while the request is in flight. ``max_prefix_len``: the most tokens the
        match may reach (SGLang's ``Req._compute_max_prefix_len``: ``len - 1``, fewer for prompt
        logprobs; None, the replays' default: all). ``output_ids``: the tokens the request
        generates (``max_new_tokens`` of them, as a live server returns them), decoded as SGLang
        does (``decode``); None, the replays' default: a prompt that finishes at its prefill
        (``max_new_tokens`` 1, which leaves only the prompt in the tree)."""
        f = self.begin(token_ids, tenant=tenant, no_store=no_store, extra_key=extra_key, max_prefix_len=max_prefix_len,
                       output_ids=output_ids)  # fmt: skip
        if isinstance(f, RequestOutcome):
            return f
        if during is not None:
            during()
        if output_ids is not None:
            self.decode(f, output_ids)
        return self.end(f)

    def begin(self, token_ids, *, tenant=None, no_store=False, extra_key=None,
              max_prefix_len=None, output_ids=None) -> "InFlight | RequestOutcome":  # fmt: skip
        """A request's admission, as ``PrefillAdder`` does it: match (and load back from T1), lock,
        allocate its uncached tokens with eviction, then its forward pass. Returns the request in
        flight, or an unserved ``RequestOutcome`` when its tokens cannot fit even after eviction
        (the scheduler would keep it waiting); ``end`` (or ``checkpoint_chunk`` first) finishes it.
        With ``output_ids`` (the request decodes, see ``decode``) admission and eviction are the
        scheduler's for a request with ``max_new_tokens``: it is admitted when its uncached
        tokens, its ``max_new_tokens`` and a page (``per_req_token_overhead``) fit under the free
        and evictable ones (``PrefillAdder.add_one_req``), and at page size over 1 the extend
        evicts for its tokens and a page more (``alloc_paged_token_slots_extend``)."""
        cache, alloc = self.cache, self.allocator
        self._n += 1
        req = SimReq(f"sim-{self._n}", token_ids, cache_salt=tenant, extra_key=extra_key, no_store=no_store)
        if output_ids is not None:  # (as a live server's Req: the tiered cache then knows it decodes)
            req.sampling_params = SimpleNamespace(max_new_tokens=len(output_ids))
        n = len(req.origin_input_ids)
        t0 = time.perf_counter()
        key = RadixKey(req.origin_input_ids, req.extra_key, cache_salt=req.cache_salt, limit=max_prefix_len)
        m = cache.match_prefix(MatchPrefixParams(key=key, req=req))
        prefix_len = m.device_prefix_len
        req.last_node = m.last_device_node
        host_loaded = 0
        if m.host_hit_length > 0:  # as the scheduler does: PrefillAdder -> init_load_back
            from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

            loaded = cache.init_load_back(
                InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=req)
            )
            if loaded is not None:
                host_loaded, node = loaded
                assert host_loaded in (0, m.host_hit_length), "partial load-back"
                if host_loaded:
                    req.last_node = node
                    prefix_len += host_loaded
                    self.host_loaded_tokens += host_loaded
        req.lock = cache.lock(req.last_node)
        prefix_idx = cache.path_device_indices(req.last_node) if prefix_len else None
        need = n - prefix_len
        # SGLang's PrefillAdder takes a request only when its tokens fit the free and the evictable
        # ones (``rem_total_tokens``): one that cannot fit waits, and nothing is evicted for it.
        # Before, the driver evicted for it first and then dropped it: both caches emptied for a
        # request neither served, which SGLang never does, and the tiered policy's lru shadow
        # (fed from checkpoints) never saw that eviction, so its yardstick drifted from the real
        # cache (a helper's hunt, session 32: 0.87 points below lru on a trace with prompts
        # longer than the pool; tests/test_review32.py)
        fits = need <= alloc.available_size() + cache.evictable_size()
        want = need
        if output_ids is not None:
            fits = need + len(output_ids) + alloc.page_size < alloc.available_size() + cache.evictable_size()
            want = need + (alloc.page_size if alloc.page_size > 1 and need else 0)
        if fits and want > alloc.available_size():
            cache.evict(EvictParams(num_tokens=want - alloc.available_size()))
        new_idx = (alloc.alloc(need) if need else torch.empty(0, dtype=torch.int64)) if fits else None
        spent = time.perf_counter() - t0
        if new_idx is None:  # cannot fit, even after eviction: dropped here
            cache.unlock(req.lock)
            # SGLang refuses a prompt longer than its pool before it is queued, and finishes one
            # aborted while waiting without ``release_kv_cache`` (``release_aborted_request``): the
            # cache forgets it (before, the tiered cache kept it "in flight" for good, so every
            # later request counted as overlapping and its policy stayed at lru: review, session 24)
            cache.release_aborted_request(CacheRequestHandle(rid=req.rid, attempt_id=0))  # (SGLang's argument)
            return RequestOutcome(n, 0, spent, served=False)
        row = self.req_pool.alloc_row()
        req.kv.req_pool_idx = row
        rt = self.req_pool.req_to_token
        if prefix_len:
            rt[row, :prefix_len] = prefix_idx
        rt[row, prefix_len:n] = new_idx
        req.kv.cache_protected_len = prefix_len
        req.kv.kv_allocated_len = n
        # --- the forward pass would run here ---
        if self.verify_kv:
            self._forward(req, rt[row, :n], prefix_len)
        return InFlight(req, row, n, prefix_len, spent)

    def decode(self, f: "InFlight", output_ids) -> None:
        """The request's decode, as SGLang runs it for ``max_new_tokens`` = ``len(output_ids)``:
        the prefill's ``checkpoint_kv_cache`` (the prompt into the tree, its lock moved to the
        prompt's end), then one step per output token but the last, each evicting until a page is
        free (``alloc_paged_token_slots_decode``: a page per request at every step; page size 1:
        a token) and taking the slot of the token it computes. ``end`` then checkpoints the
        prompt and every output token but the last, whose KV is never computed
        (``owned_kv_len``), as ``release_kv_cache`` does: a live server's tree holds what the
        request generated, and those pages take the device pool from cached prompts (on a trace
        whose next turns do not repeat this model's outputs, pages no later request matches)."""
        k = len(output_ids) - 1
        if k <= 0:  # finished at its prefill: nothing decoded, no checkpoint before the release
            return
        self.checkpoint_chunk(f, f.n)
        cache, alloc, req, row = self.cache, self.allocator, f.req, f.row
        rt = self.req_pool.req_to_token
        page = alloc.page_size
        t1 = time.perf_counter()
        pos = f.n
        for _ in range(k):
            if alloc.available_size() < page:
                cache.evict(EvictParams(num_tokens=page - alloc.available_size()))
            if pos % page:  # the next slot of the request's last page
                rt[row, pos] = rt[row, pos - 1] + 1
            else:
                slot = alloc.alloc(1)
                if slot is None:  # (SGLang retracts the request here; no replay gets this far)
                    raise RuntimeError(f"decode step of {req.rid} does not fit the pool")
                rt[row, pos] = slot[0]
            pos += 1
        req.full_untruncated_fill_ids = array("q", list(req.origin_input_ids) + [int(t) for t in output_ids])
        req.kv.kv_allocated_len = pos
        f.kv_len = pos
        f.seconds += time.perf_counter() - t1

    def checkpoint_chunk(self, f: "InFlight", up_to: int) -> None:
        """The scheduler's ``cache_unfinished_req`` after a prefill chunk (``--chunked-prefill-size``):
        the request's tokens up to ``up_to`` go into the tree and its lock moves to their end."""
        t1 = time.perf_counter()
        if not f.req.skip_radix_cache_insert:
            self.cache.checkpoint(f.req, up_to=up_to)
        f.seconds += time.perf_counter() - t1

    def end(self, f: "InFlight") -> RequestOutcome:
        """``release_kv_cache``: checkpoint the whole request, free the unadopted tail, unlock,
        ``on_release``; then the end-of-batch flush."""
        cache, alloc, req, n, row = self.cache, self.allocator, f.req, f.n, f.row
        kv_len = f.kv_len or n
        rt = self.req_pool.req_to_token
        t1 = time.perf_counter()
        if not req.skip_radix_cache_insert:
            cache.checkpoint(req, up_to=kv_len)
        cpl = req.kv.cache_protected_len
        if cpl < kv_len:
            alloc.free_segment(rt[row, cpl:kv_len], start_pos=cpl)
        cache.unlock(req.lock)
        req.lock = None
        self.req_pool.free_row(row)
        req.cached_tokens = f.prefix_len
        # timed too: SGLang's release_kv_cache calls on_release (a no-op in its own caches; the
        # tiered cache's per-request state goes there), and the flush is the cache's own
        # end-of-batch work (before, both fell outside the timed region: the tiered cache's
        # bookkeeping was undercounted by their cost, a few us a request)
        cache.on_release(req, checkpointed=True)
        cache.flush_pending_backups()  # the scheduler calls it after every batch
        spent = f.seconds + time.perf_counter() - t1
        return RequestOutcome(n, f.prefix_len, spent)

    def _forward(self, req, slots: torch.Tensor, prefix_len: int) -> None:
        """Check the cached prefix holds exactly what recomputation gives, then 'compute' the rest."""
        kv = self.allocator.get_kvcache()
        L, H, D = len(kv.k_buffer), kv.head_num, kv.head_dim
        want = expected_kv(req.origin_input_ids, (req.cache_salt, req.extra_key), L, H, D)
        for layer in range(L):
            for j, buf in enumerate((kv.k_buffer[layer], kv.v_buffer[layer])):
                if prefix_len:
                    got = buf[slots[:prefix_len]]
                    assert torch.equal(got, want[:prefix_len, layer, j]), "cache hit differs from recomputation"
                buf[slots[prefix_len:]] = want[prefix_len:, layer, j]

    def device_accounting(self) -> tuple[int, int, int, int]:
        """(available, evictable, protected, total) device tokens."""
        c = self.cache
        return (self.allocator.available_size(), c.evictable_size(), c.protected_size(), self.allocator.size)


def make_params(capacity_tokens: int, page_size: int, max_len: int = 1 << 15, eviction_policy="lru",
                with_kv: bool = False):  # fmt: skip
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    kv = SimKVCache(capacity_tokens // page_size * page_size + page_size, page_size) if with_kv else None
    allocator = SimPageAllocator(capacity_tokens, page_size, kv)
    pool = SimReqToTokenPool(4, max_len)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        eviction_policy=eviction_policy,
    )
    return params, allocator, pool


def replay_concurrent(driver: CacheDriver, requests, *, batch: int, chunk: int = 0, decode_ticks: int = 1):
    """Replay ``requests`` ((token_ids, tenant) pairs) with up to ``batch`` of them in flight, as
    SGLang's continuous batching interleaves them: each tick admits waiting requests while fewer
    than ``batch`` run (``begin``: match, lock, allocate with eviction), then every running
    request runs one prefill chunk of ``chunk`` tokens (0: the whole prompt), checkpointed as
    ``cache_unfinished_req`` does when more remains, and a request ``decode_ticks`` ticks past its
    prefill ends (``release_kv_cache``). So several requests hold locks, match while others'
    KV is not yet in the tree, and insert the same new prefix twice. A request that cannot fit
    waits for running ones to end, as the scheduler keeps it queued; one that cannot fit alone is
    unserved. Each request's whole prompt is allocated at admission (the scheduler's budget
    counts it whole too). Returns the ``RequestOutcome``s in request order."""
    from collections import deque

    waiting = deque(enumerate(requests))
    outcomes: list = [None] * len(requests)
    running: list = []  # [index, InFlight, tokens done, decode ticks left]
    while waiting or running:
        while waiting and len(running) < batch:
            i, (tokens, tenant) = waiting[0]
            f = driver.begin(tokens, tenant=tenant)
            if isinstance(f, RequestOutcome):
                if running:
                    break  # waits for running requests to end
                outcomes[i] = f
                waiting.popleft()
                continue
            waiting.popleft()
            running.append([i, f, f.prefix_len, decode_ticks])
        still = []
        for item in running:
            i, f, done, left = item
            if done < f.n:
                done = f.n if chunk <= 0 else min(done + chunk, f.n)
                if done < f.n:
                    driver.checkpoint_chunk(f, done)
                item[2] = done
                still.append(item)
            elif left > 1:
                item[3] = left - 1
                still.append(item)
            else:
                outcomes[i] = driver.end(f)
        running = still
    return outcomes
