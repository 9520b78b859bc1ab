"""A strict simulated scheduler (a review helper's harness, session 24): drives TieredRadixCache in
SGLang 0.5.23's real call order (match with the
max_prefix_len limit, chunked prefill via checkpoint, decode with output tokens and split_prompt,
release_kv_cache with/without checkpoint, retraction, abort), over a STRICT page allocator that
raises on double free / alloc of a used page, and a KV-content oracle: every slot's KV value is a
hash of (namespace, tokens[:pos+1]) written at "forward" time.

Oracle checked by `check()`:
  O1 every tree node's slots hold the KV of exactly its path's tokens (no wrong KV);
  O2 no tree slot is free, no slot in two nodes;
  O3 every live request's row [0, kv_len) holds its own tokens' KV and is allocated;
  O4 request-owned pages are disjoint from the tree and from other requests;
  O5 free pages + tree pages + request-owned pages == all pages (no leak);
  O6 evictable_size_ + protected_size_ == tokens in tree, protected == sum over locked nodes;
  O7 cache.check_invariants().
"""
from __future__ import annotations

import hashlib
import random
from array import array

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_tiered.core.policy import PolicyConfig
from sglang_tiered.core.tenants import name_hash, tenant_of
from sglang_tiered.dev.simulate import SimKVCache, SimPageAllocator, SimReq, SimReqToTokenPool
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache


class DoubleFree(AssertionError):
    pass


class StrictAlloc(SimPageAllocator):
    """The simulator's allocator, strict: a page freed twice (or not handed out) raises, and the
    pages in use are kept (``used``) for the oracle."""

    def __init__(self, capacity_tokens, page_size, kv):
        super().__init__(capacity_tokens, page_size, kv)
        self.used = set()

    def alloc_pages(self, n):
        if n > len(self.free_pages):
            return None
        out = [self.free_pages.pop() for _ in range(n)]
        for p in out:
            assert p not in self.used
            self.used.add(p)
        return out

    def alloc(self, num_tokens):
        pages = self.alloc_pages(-(-num_tokens // self.page_size))
        if pages is None:
            return None
        t = torch.tensor(pages, dtype=torch.int64)
        return (t[:, None] * self.page_size + self._offsets).reshape(-1)[:num_tokens]

    def free(self, indices):
        if indices.numel() == 0:
            return
        for p in torch.unique(indices // self.page_size).tolist():
            if p not in self.used:
                raise DoubleFree(f"double free of page {p}")
            self.used.discard(p)
            self.free_pages.append(p)

    def free_segments(self, segs):
        for idx, start in segs:
            self.free_segment(idx, start_pos=start)


def kv_value(ns, tokens_prefix) -> float:
    h = hashlib.blake2b(repr((ns, tuple(tokens_prefix))).encode(), digest_size=4).digest()
    return float(int.from_bytes(h, "little") % (1 << 23) + 1)


class Req(SimReq):
    """The simulator's request (``SimReq``: the fields the tree cache reads) with decode state."""

    _n = 0

    def __init__(self, tokens, *, salt=None, extra_key=None, no_store=False, max_new=0, rid=None):
        Req._n += 1
        super().__init__(rid or f"r{Req._n}", array("q", tokens), cache_salt=salt, extra_key=extra_key,
                         no_store=no_store)  # fmt: skip
        self.full_untruncated_fill_ids = array("q", tokens)  # (its own: decode replaces it)
        self.output_ids = array("q")
        self.max_new = max_new
        self.prefix_len = 0
        self.extend_end = 0
        self.done = False
        self.sampling_params = None

    def finished(self):
        return self.done

    def refresh_fill_ids(self):
        self.full_untruncated_fill_ids = self.origin_input_ids + self.output_ids

    @property
    def ns(self):
        return (self.cache_salt, self.extra_key)


class Sim:
    def __init__(self, capacity_tokens=64, page_size=4, *, eagle=False, policy_config=None, host_pages=0,
                 fuzz_admit=None, max_len=512):
        self.ps = page_size
        self.kvbuf = SimKVCache(capacity_tokens // page_size * page_size + page_size, page_size, layers=1, heads=1,
                                head_dim=1)
        self.alloc = StrictAlloc(capacity_tokens, page_size, self.kvbuf)
        self.pool = SimReqToTokenPool(8, max_len)
        params = CacheInitParams(disable=False, req_to_token_pool=self.pool, token_to_kv_pool_allocator=self.alloc,
                                 page_size=page_size, is_eagle=eagle)
        self.cache = TieredRadixCache(params, policy_config=policy_config, capacity_tokens=self.alloc.size)
        if host_pages:
            from sglang_tiered.tier.host_tier import HostTier

            host = HostTier.build(self.kvbuf, page_size=page_size, total_kv_heads=1, tp_size=1, tp_rank=0,
                                  capacity_pages=host_pages, name=None, staging_pages=0)
            self.cache.attach_host(host, None)
        if fuzz_admit is not None:  # any prefix of new pages is a legal policy answer
            pol = self.cache.policy
            orig = pol.admit_pages

            def admit_pages(new, vf):
                n = orig(new, vf)
                return min(n, fuzz_admit(len(new)))

            pol.admit_pages = admit_pages
        self.live: list[Req] = []  # holding a row

    # ---------------------------------------------------------------- KV
    def _write(self, req, pos_lo, pos_hi):
        row = self.pool.req_to_token[req.kv.req_pool_idx]
        toks = req.full_untruncated_fill_ids
        for p in range(pos_lo, pos_hi):
            v = kv_value(req.ns, toks[: p + 1])
            self.kvbuf.k_buffer[0][int(row[p]), 0, 0] = v

    def _read(self, slot):
        return float(self.kvbuf.k_buffer[0][int(slot), 0, 0])

    def _alloc_positions(self, req, lo, hi):
        """SGLang's paged alloc_extend: continue the row's last partial page, then new pages."""
        ps = self.ps
        row = self.pool.req_to_token[req.kv.req_pool_idx]
        if hi <= lo:
            return True
        first_new_page_pos = -(-lo // ps) * ps
        need_pages = max(0, -(-(hi - first_new_page_pos) // ps))
        avail = self.alloc.available_size() // ps
        if need_pages > avail:
            self.cache.evict(EvictParams(num_tokens=(need_pages - avail) * ps))
        pages = self.alloc.alloc_pages(need_pages)
        if pages is None:
            return False
        for p in range(lo, min(hi, first_new_page_pos)):
            row[p] = row[p - 1] + 1
        k = 0
        for p in range(first_new_page_pos, hi):
            if p % ps == 0:
                base = pages[k] * ps
                k += 1
            row[p] = base + p % ps
        return True

    # ---------------------------------------------------------------- scheduler steps
    def match(self, req):
        fill = req.full_untruncated_fill_ids
        key = RadixKey(fill, req.extra_key, limit=max(len(fill) - 1, 0), cache_salt=req.cache_salt)
        m = self.cache.match_prefix(MatchPrefixParams(key=key, req=req))
        req.prefix_len = m.device_prefix_len
        req.last_node = m.last_device_node
        req.kv.cache_protected_len = req.prefix_len
        return m

    def admit(self, req, chunk=0):
        """init_next_round_input + add_one_req + prepare_for_extend (alloc) + forward."""
        req.refresh_fill_ids()
        m = self.match(req)
        if m.host_hit_length > 0:
            lk = self.cache.lock(req.last_node)
            loaded = self.cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                                  host_hit_length=m.host_hit_length, req=req))
            self.cache.unlock(lk)
            if loaded is None:
                return False
            n, node = loaded
            req.last_node = node
            req.prefix_len += n
            req.kv.cache_protected_len = req.prefix_len
        L = len(req.full_untruncated_fill_ids)
        ext = L - req.prefix_len if not chunk else min(chunk, L - req.prefix_len)
        req.extend_end = req.prefix_len + ext
        req.lock = self.cache.lock(req.last_node)
        row = self.pool.alloc_row()
        req.kv.req_pool_idx = row
        if req.prefix_len:
            self.pool.req_to_token[row, : req.prefix_len] = self.cache.path_device_indices(req.last_node)[
                : req.prefix_len]
        # verify the hit BEFORE computing the rest
        for p in range(req.prefix_len):
            want = kv_value(req.ns, req.full_untruncated_fill_ids[: p + 1])
            got = self._read(self.pool.req_to_token[row, p])
            assert got == want, f"WRONG KV served to {req.rid} at pos {p}"
        if not self._alloc_positions(req, req.prefix_len, req.extend_end):
            self.cache.unlock(req.lock)
            req.lock = None
            self.pool.free_row(row)
            req.kv.req_pool_idx = None
            return False
        req.kv.kv_allocated_len = req.extend_end
        self._write(req, req.prefix_len, req.extend_end)
        req.kv.kv_committed_len = req.extend_end
        self.live.append(req)
        return True

    def prefilling(self, req):
        return req.extend_end < len(req.full_untruncated_fill_ids)

    def next_chunk(self, req, chunk):
        """checkpoint_kv_cache after the previous chunk ran, then the next chunk."""
        assert not req.finished()
        self.cache.checkpoint(req, up_to=req.extend_end)
        req.prefix_len = req.extend_end
        L = len(req.full_untruncated_fill_ids)
        hi = min(L, req.extend_end + chunk)
        if not self._alloc_positions(req, req.extend_end, hi):
            return False
        req.kv.kv_allocated_len = hi
        self._write(req, req.extend_end, hi)
        req.extend_end = hi
        req.kv.kv_committed_len = hi
        return True

    def postfill(self, req):
        """SGLang's checkpoint right after a request's last prefill chunk, while it goes on to
        decode (mem_cache/common.py ``checkpoint_kv_cache``; review, session 25)."""
        if not req.skip_radix_cache_insert:
            self.cache.checkpoint(req, up_to=req.extend_end)
        req.prefix_len = req.extend_end

    def decode(self, req, tok):
        """After the prefill: output tokens; each decode step computes the KV of the last output."""
        req.refresh_fill_ids()
        pos = req.kv.kv_committed_len
        if pos == len(req.full_untruncated_fill_ids):  # the prefill (or last step) produced the next token
            req.output_ids.append(tok)
            req.refresh_fill_ids()
            req.extend_end = len(req.full_untruncated_fill_ids)
            return True
        assert pos == len(req.full_untruncated_fill_ids) - 1
        if not self._alloc_positions(req, pos, pos + 1):
            return False
        req.kv.kv_allocated_len = pos + 1
        self._write(req, pos, pos + 1)
        req.kv.kv_committed_len = pos + 1
        req.output_ids.append(tok)
        req.refresh_fill_ids()
        req.extend_end = len(req.full_untruncated_fill_ids)
        return True

    def release(self, req, checkpoint=True):
        """common.release_kv_cache."""
        owned = req.kv.kv_committed_len
        if checkpoint:
            req.done = True
            req.refresh_fill_ids()
            if not req.skip_radix_cache_insert:
                self.cache.checkpoint(req, up_to=owned)
        cpl = req.kv.cache_protected_len
        if cpl < owned:
            self.alloc.free_segment(self.pool.req_to_token[req.kv.req_pool_idx, cpl:owned], start_pos=cpl)
        self.cache.unlock(req.lock)
        req.lock = None
        self.cache.on_release(req, checkpointed=checkpoint)
        self.pool.free_row(req.kv.req_pool_idx)
        req.kv.req_pool_idx = None
        req.kv.kv_allocated_len = 0
        self.live.remove(req)
        self.cache.flush_pending_backups()

    def retract(self, req):
        self.release(req, checkpoint=False)
        # reset_for_retract
        req.prefix_len = 0
        req.last_node = None
        req.kv.cache_protected_len = 0
        req.kv.cache_inserted_len = 0
        req.lock = None
        req.extend_end = 0
        req.kv.kv_committed_len = 0
        req.done = False

    # ---------------------------------------------------------------- oracle
    def tree_nodes(self):
        out, stack = [], [(self.cache.root_node, [])]
        while stack:
            n, toks = stack.pop()
            for c in n.children.values():
                k = c.key
                t = list(k.token_ids[: len(k)])
                stack.append((c, toks + t))
                out.append((c, toks + t, len(toks)))
        return out

    def check(self):
        c, ps = self.cache, self.ps
        tree_slots = {}
        ev = pr = 0
        for n, toks, depth in self.tree_nodes():
            ns = (n.key.cache_salt, n.key.extra_key)
            assert n.value is not None and len(n.value) == len(n.key), "node value/key length"
            if n.lock_ref > 0:
                pr += len(n.key)
            else:
                ev += len(n.key)
            for i, s in enumerate(n.value.tolist()):
                assert s not in tree_slots, f"O2: slot {s} in two nodes"
                tree_slots[s] = n
                assert s // ps in self.alloc.used, f"O2: tree node {n.id} references freed slot {s}"
                want = kv_value(ns, toks[: depth + i + 1])
                assert self._read(s) == want, f"O1: WRONG KV in tree node {n.id} at depth {depth + i}"
        assert (ev, pr) == (c.evictable_size_, c.protected_size_), ("O6", ev, pr, c.evictable_size_,
                                                                   c.protected_size_)
        tree_pages = {s // ps for s in tree_slots}
        owned_pages = set()
        for r in self.live:
            row = self.pool.req_to_token[r.kv.req_pool_idx]
            cpl = r.kv.cache_protected_len
            kvl = r.kv.kv_committed_len
            if r.last_node is not c.root_node:
                assert r.last_node.lock_ref > 0, "request's last_node not locked"
            path = c.path_device_indices(r.last_node).tolist()
            assert row[:cpl].tolist() == path[:cpl], "O3: tree-owned row part != locked path"
            for p in range(kvl):
                s = int(row[p])
                assert s // ps in self.alloc.used, f"O3: {r.rid} row pos {p} slot {s} is free"
                want = kv_value(r.ns, r.full_untruncated_fill_ids[: p + 1])
                assert self._read(s) == want, f"O3: {r.rid} row pos {p} holds wrong KV"
            mine = {int(row[p]) // ps for p in range(cpl, kvl)}
            assert not (mine & tree_pages), f"O4: {r.rid} owns pages the tree holds: {mine & tree_pages}"
            assert not (mine & owned_pages), f"O4: {r.rid} shares owned pages with another request"
            owned_pages |= mine
        free = set(self.alloc.free_pages)
        assert len(free) == len(self.alloc.free_pages)
        allp = set(range(1, self.alloc.num_pages + 1))
        leaked = allp - free - tree_pages - owned_pages
        assert not leaked, f"O5: leaked pages {sorted(leaked)}"
        c.check_invariants()
        # tenant accounting: resident_pages per tenant == the tree's pages of that tenant
        import collections
        want = collections.Counter()
        for n, _t, _d in self.tree_nodes():
            want[id(c.tenant(n.key.cache_salt))] += len(n.key) // ps
        for tc in c.tenants.by_name.values():
            if tc.resident_pages != want.get(id(tc), 0):
                raise AssertionError(f"O8: tenant resident_pages {tc.resident_pages} != tree pages {want.get(id(tc), 0)}")


# ---------------------------------------------------------------- a random long run (by seed)
BLOCK = 4
BLOCKS = [[b * 10 + i for i in range(BLOCK)] for b in range(1, 6)]
PROMPTS = [[], [0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 2], [1], [1, 2], [0, 1, 3], [3, 4]]


def run(seed, opts, log=None):
    """One random run of ``opts['steps']`` scheduler operations (reproducible by ``seed``), every
    oracle checked after each."""
    rng = random.Random(seed)
    ps = opts.get("ps", rng.choice([1, 2, 4]))
    eagle = opts.get("eagle", 0)
    host = opts.get("host", rng.choice([0, 8]))
    fz = opts.get("fuzz", rng.choice([0, 1]))
    mode = opts.get("mode", rng.choice([None, "all+lru", "tinylfu+adaptive", "tinylfu+slru"]))
    ops = set(opts.get("ops", "new,admit,chunk,decode,finish,abort,retract,evict,flush,inv,probe").split(","))
    cap = opts.get("cap", 48)
    # the checkpoint after an unfinished request's last prefill chunk (no rng draw: seeds unchanged)
    postfill = opts.get("postfill", 0)
    fa = (lambda n: rng.randint(0, n)) if fz else None
    sim = Sim(cap, ps, eagle=bool(eagle), host_pages=host,
              policy_config=PolicyConfig(force_mode=mode, pin_min_freq=3, pin_max_tokens=2 * ps), fuzz_admit=fa)
    cfg = dict(ps=ps, eagle=eagle, host=host, fuzz=fz, mode=mode)
    if log is not None:
        log.append(("build", cfg))
    waiting = []
    for step in range(opts.get("steps", 200)):
        op = rng.choice(["new", "new", "admit", "admit", "chunk", "chunk", "decode", "decode", "decode", "finish",
                         "finish", "abort", "retract", "evict", "flush", "inv", "probe", "probe", "weights"])
        if op not in ops:
            continue
        if op == "new" and len(waiting) < 4:
            toks = [t for b in rng.choice(PROMPTS) for t in BLOCKS[b]] + [900 + i for i in range(rng.randint(0, 5))]
            toks = toks or [7]
            r = Req(toks, salt=rng.choice([None, "acme"]) if opts.get("salts", 1) else None,
                    extra_key=rng.choice([None, "lora1"]) if opts.get("extras", 1) else None,
                    no_store=rng.random() < 0.1, max_new=rng.randint(0, 5))
            waiting.append(r)
            desc = (op, r.rid, toks, r.cache_salt, r.extra_key, r.no_store)
        elif op == "weights":
            flush = rng.random() < 0.5 and not sim.live
            if flush:  # weight_updater: flush_cache() then the hook
                sim.cache.reset()
                a = sim.alloc
                a.free_pages = list(range(a.num_pages, 0, -1))
                a.used = set()
            if rng.random() < 0.3:
                sim.cache.on_weight_session_begin()
                desc = (op, "session_begin")
            else:
                sim.cache.on_weights_updated(weight_version=str(step), source=rng.choice(["weights update", "end_weight_update"]))
                desc = (op, flush)
        elif op == "probe" and waiting:
            r = rng.choice(waiting)
            r.refresh_fill_ids()
            sim.match(r)   # calc_priority / a failed add_one_req: matched (maybe split, T1 probed), not admitted
            desc = (op, r.rid, r.prefix_len)
        elif op == "admit" and waiting and len(sim.live) < 4:
            r = rng.choice(waiting)
            chunk = rng.choice([0, 1, 3, 4, 6])
            ok = sim.admit(r, chunk)
            if ok:
                waiting.remove(r)
                if postfill and not sim.prefilling(r):
                    sim.postfill(r)
            desc = (op, r.rid, chunk, ok, r.prefix_len)
        elif op == "chunk":
            c = [r for r in sim.live if sim.prefilling(r)]
            if not c:
                continue
            r = rng.choice(c)
            k = rng.choice([1, 2, 4, 5])
            sim.next_chunk(r, k)
            if postfill and not sim.prefilling(r):
                sim.postfill(r)
            desc = (op, r.rid, k)
        elif op == "decode":
            c = [r for r in sim.live if not sim.prefilling(r) and len(r.output_ids) < r.max_new + 1]
            if not c:
                continue
            r = rng.choice(c)
            t = rng.randint(500, 503)
            sim.decode(r, t)
            desc = (op, r.rid, t)
        elif op == "finish":
            c = [r for r in sim.live if not sim.prefilling(r)]
            if not c:
                continue
            r = rng.choice(c)
            if r.kv.kv_committed_len == len(r.origin_input_ids) + len(r.output_ids):
                sim.decode(r, 501)
            sim.release(r, checkpoint=True)
            desc = (op, r.rid)
        elif op == "abort" and sim.live:
            r = rng.choice(sim.live)
            sim.release(r, checkpoint=False)
            desc = (op, r.rid)
        elif op == "retract":
            c = [r for r in sim.live if not sim.prefilling(r)]
            if not c:
                continue
            r = rng.choice(c)
            sim.retract(r)
            waiting.append(r)
            desc = (op, r.rid)
        elif op == "evict":
            n = rng.randint(1, cap)
            sim.cache.evict(EvictParams(num_tokens=n))
            desc = (op, n)
        elif op == "flush" and not sim.live:
            sim.cache.reset()
            a = sim.alloc
            a.free_pages = list(range(a.num_pages, 0, -1))
            a.used = set()
            desc = (op,)
        elif op == "inv":
            s = rng.choice([None, "acme", "__all__"])
            if s == "__all__":
                sim.cache.invalidate(everything=True)
            else:
                sim.cache.invalidate(tenant_hash=name_hash(tenant_of(s)))
            desc = (op, s)
        else:
            continue
        if log is not None:
            log.append(desc)
        sim.check()
    for r in list(sim.live):
        sim.release(r, checkpoint=False)
    sim.check()
    assert sim.cache.protected_size_ == 0
