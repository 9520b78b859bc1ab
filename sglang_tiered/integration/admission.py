"""Admission: what ``checkpoint`` lets the device tree adopt of a request's new pages.

SGLang's ownership contract is kept: the tree owns ``[0, req.kv.cache_protected_len)`` of a
request's KV row, and whatever ``checkpoint`` does not adopt is freed by ``release_kv_cache``
(sglang/srt/mem_cache/common.py:400-444). We never pass ``checkpoint`` an ``up_to`` below
``cache_protected_len`` (that would double-free tree pages).

Per request: reuse is counted once (DESIGN.md decision 5) on its first checkpoint, its new pages
are hashed once, the policy decides how many of them to keep (TinyLFU against the next victim
while filtering is on), refused pages go to T1, and a cold prompt's new nodes enter aged.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from sglang_tiered.core.eviction import is_reused
from sglang_tiered.integration import tree_ops
from sglang_tiered.integration.clock import bump_hits

COUNTED_MAX = 65536  # requests between their first checkpoint and their release (aborted ones age out)
# ``TieredRadixCache.in_flight``'s value for a request whose pages the policy has been shown
SEEN = object()


class AdmissionPlan(NamedTuple):
    """What one ``checkpoint`` call adopts: ``[cpl, admit_len)`` of the request's row."""

    anchor: object  # the request's last tree node before this checkpoint
    cpl: int  # cache_protected_len (tokens the tree already owns)
    admit_len: int  # tokens up to which SGLang's checkpoint runs
    hashes: Optional[list]  # page hashes of the request up to its page-aligned length (None: not hashed)
    admitted: list  # hashes of the newly admitted pages
    before_tokens: int  # tree tokens before the insert (to count what was stored)


def no_store(req) -> bool:
    """The request asked not to be stored (``no_store`` or LMCache's ``lmcache.skip_save``)."""
    if getattr(req, "no_store", False):
        return True
    sp = getattr(req, "sampling_params", None)
    cp = getattr(sp, "custom_params", None)
    return bool(cp) and isinstance(cp, dict) and cp.get("lmcache.skip_save") is True


class Admission:
    def __init__(self, cache):
        self.cache = cache
        self.counted: dict[str, int] = {}  # rid -> pages already counted in the sketch

    def reset(self) -> None:
        self.counted.clear()

    def forget(self, rid) -> None:
        self.counted.pop(rid, None)

    def _first_sighting(self, rid) -> Optional[int]:
        counted = self.counted.get(rid)
        if counted is None:
            if len(self.counted) >= COUNTED_MAX:  # never released (aborted): forget the oldest
                del self.counted[next(iter(self.counted))]
            self.counted[rid] = 0
            self.cache.policy.begin_request()
        return counted

    def plan(self, req, up_to: int) -> Optional[AdmissionPlan]:
        """Decide what to adopt; None when nothing is (the request's row is left alone)."""
        cache, policy = self.cache, self.cache.policy
        ps = cache.page_size
        cpl = req.kv.cache_protected_len
        # the tokens SGLang's insert covers: under EAGLE its key is bigrams, one fewer than the
        # tokens (``eagle``), page-aligned (before, one page too many was counted as stored and
        # told to the index and the duel, and a partial admission lost a page: review, session 24)
        eagle = int(cache.is_eagle)
        aligned = ((up_to - eagle) // ps) * ps
        anchor = req.last_node if req.last_node is not None else cache.root_node
        # KV computed under an older identity epoch (a weight update or an invalidation since the
        # request matched) is never adopted: left to the request, freed at its release
        stale = getattr(req, "tiered_epoch", cache.epoch) != cache.epoch
        refuse_all = no_store(req)
        counted = self._first_sighting(req.rid)
        first = counted is None
        if first and getattr(req, "tiered_released", False):
            # SGLang released it unfinished (a retraction at decode, a priority preemption) and it
            # is prefilled again: counted each time (on_release counts the request itself once)
            cache.tenant(req.cache_salt).requeued_requests += 1
        if refuse_all and not stale and not anchor.tiered_invalid and not cache.invalidation.next_is_invalid(anchor, req, cpl):
            return self._unstored(req, first, anchor, cpl, aligned)
        if refuse_all or stale or anchor.tiered_invalid or cache.invalidation.next_is_invalid(anchor, req, cpl):
            # Refuse: leave row, lock, last_node and cache_protected_len alone; release_kv_cache
            # frees [cache_protected_len, owned). No-store requests leave no trace (not even in
            # the sketch; on_release counts them); paths through invalidated entries are never extended.
            return None
        if cache.hashes_read():
            base = cache.path_hashes(anchor)
            assert len(base) * ps == cpl or anchor is cache.root_node, (len(base), cpl)
            prev = base[-1] if base else cache.hashes.seed(req.extra_key, req.cache_salt)
            tokens = req.full_untruncated_fill_ids
            # (EAGLE: a page's hash takes the token after it too, as the tree's bigram key does)
            new = cache.hashes.chain(prev, tokens[len(base) * ps : aligned + eagle], ps, eagle) if aligned > cpl else []
            hashes = base + new
            n_admit = self._decide(req, first, counted or 0, base, new, hashes, int(up_to > aligned), up_to)
        else:  # nothing reads a page hash: the same counts, no hashing (``hashes_read``)
            hashes, new = None, []
            n_base = 0 if anchor is cache.root_node else cpl // ps  # (len(base) above)
            n_new = (aligned - n_base * ps) // ps if aligned > cpl else 0
            n_admit = self._count(req, first, counted or 0, n_base, n_new, int(up_to > aligned))
        admit_len = cpl + n_admit * ps
        if n_admit < len(new) and cache.t1 is not None:
            cache.t1.on_refused(req, admit_len, new[n_admit:])
        if admit_len <= cpl:
            if first:
                bump_hits(anchor, cache.root_node)  # still count the prefix reuse
            # SGLang's checkpoint walks the path (insert, then its re-match) whatever it adds, so
            # the path is touched at every checkpoint: the first, a later prefill chunk's, and the
            # release of a request whose last chunk held only a partial page. Between them other
            # requests run (continuous batching), so skipping the touch reorders eviction
            # (tests/test_concurrency.py).
            tree_ops.touch(cache, anchor)
            return None
        if admit_len >= aligned:
            admit_len = up_to  # admit everything: let SGLang page-align as usual
        else:
            admit_len += eagle  # (SGLang's bigram key of admit_len + 1 tokens: admit_len positions)
        before = cache.evictable_size_ + cache.protected_size_
        cache.clock.now()
        return AdmissionPlan(anchor, cpl, admit_len, hashes, new[:n_admit], before)

    def _unstored(self, req, first: bool, anchor, cpl: int, aligned: int) -> Optional[AdmissionPlan]:
        """A no-store request (its KV valid, its path not invalidated): booked by the duel at its
        first checkpoint (``SafetyDuel.match_unstored``: its hits against lru's tree's), and, while
        the real cache diverges from lru's tree, the leading pages of it that lru's tree holds are
        stored back (``SafetyDuel.restorable``: never a page of its own, only one a storing request
        gave lru's tree, which SGLang's lru holds now). Returns the plan, or None: nothing kept."""
        cache, policy = self.cache, self.cache.policy
        if not policy.replays_matches or cache.is_eagle:
            return None
        ps = cache.page_size
        if first:
            key = cache.in_flight.get(req.rid)
            if key is not None and key is not SEEN:
                cache.in_flight[req.rid] = SEEN  # (booked here: not replayed again at release)
                policy.match_unstored(cache._key_pages(key), cpl // ps)
        if aligned <= cpl or not cache.hashes_read() or not policy.prices_divergence():
            return None
        base = cache.path_hashes(anchor)
        if len(base) * ps != cpl:
            return None
        prev = base[-1] if base else cache.hashes.seed(req.extra_key, req.cache_salt)
        new = cache.hashes.chain(prev, req.full_untruncated_fill_ids[cpl:aligned], ps)
        k = policy.restorable(new)
        if k == 0:
            return None
        policy.stats.restored_pages += k
        before = cache.evictable_size_ + cache.protected_size_
        cache.clock.now()
        return AdmissionPlan(anchor, cpl, cpl + k * ps, base + new, new[:k], before)

    def _decide(self, req, first: bool, counted: int, base: list, new: list, hashes: list, tail: int,
                up_to: int = 0) -> int:
        """Count the request in the sketch (once per page) and ask the policy. Returns pages kept."""
        cache, policy = self.cache, self.cache.policy
        if first and new:
            policy.on_miss(new[0])  # ghost hit? (adapts the eviction order)
        # the key SGLang matched it by (first checkpoint only: later chunks are not matched again)
        key = cache.in_flight.get(req.rid) if first else None
        # A request that decodes (session 41): SGLang's extend evicts for a page more than its
        # tokens (page size over 1; every live request, a replay's with ``output_ids``: those have
        # ``sampling_params``), and its decode evicts a page at a time before the release's
        # checkpoint adopts the decoded tokens (past the prompt: ``up_to`` over its length). The
        # tree shadows replay both (``TreeShadow.run``), or lru's yardstick evicted less than
        # SGLang's lru (tests/test_review41_bound.py).
        ps = cache.page_size
        reserve = int(first and ps > 1 and getattr(req, "sampling_params", None) is not None)
        dec = None
        n = len(req.origin_input_ids)
        if not first and up_to > n and not cache.is_eagle and counted == n // ps:
            dec = (n, up_to - n, ps)
        if self._unseen(req, first, counted, len(hashes), tail):
            # SGLang's match reaches at most len - 1 tokens (fewer for prompt logprobs): the tree
            # shadows' walk stops there too, or lru's yardstick hit what SGLang's lru recomputes
            # (a helper's audit, session 36: with prompt logprobs it showed 0.80 where lru got 0.375)
            limit = None if key is None or key is SEEN else len(key) // cache.page_size
            # (a first checkpoint shows all its pages: the list itself, not a copy; nothing writes to it)
            policy.observe(hashes[counted:] if counted else hashes, max(0, len(base) - counted), whole=hashes,
                           start=counted, tail=tail, limit=limit, reserve=reserve, decode=dec)  # fmt: skip
        elif dec is not None:  # decoded, no full page more: its evictions all the same
            policy.decoded(hashes, counted, dec)
        victim_freq = cache.eviction.victim_frequency() if (new and policy.filtering) else None
        n_admit = policy.admit_pages(new, victim_freq)
        cache.tenant(req.cache_salt).rejected_pages += len(new) - n_admit
        return n_admit

    def _count(self, req, first: bool, counted: int, base: int, new: int, tail: int) -> int:
        """``_decide`` where no page hash is read (a forced fixed order admitting everything,
        without T1 or the index): the request's counts alone, its ``new`` pages all kept."""
        policy = self.cache.policy
        if self._unseen(req, first, counted, base + new, tail):
            policy.count_request(max(0, base + new - counted), max(0, base - counted))
        return policy.admit_all(new)

    def _unseen(self, req, first: bool, counted: int, total: int, tail: int) -> bool:
        """Whether this checkpoint shows the policy pages of ``req`` it has not seen (``total``
        pages now, ``counted`` before), or a first checkpoint's partial page (a request shorter
        than a page is observed too: SGLang still gives its partial page a slot, which can evict,
        and the tree shadows replay that). Records them as seen."""
        if total > counted or (first and tail):
            self.counted[req.rid] = total
            if req.rid in self.cache.in_flight:
                self.cache.in_flight[req.rid] = SEEN  # (its match is in what the policy is shown)
            return True
        return False

    def adopted(self, req, plan: AdmissionPlan) -> None:
        """After SGLang's checkpoint inserted ``[cpl, admit_len)``: hashes, stamps, T1, aging."""
        cache, policy = self.cache, self.cache.policy
        stored = (cache.evictable_size_ + cache.protected_size_ - plan.before_tokens) // cache.page_size
        tc = cache.tenant(req.cache_salt)
        tc.admitted_pages += stored
        tc.resident_pages += stored
        if plan.hashes is not None:
            cache.hashes.attach(req.last_node, plan.hashes)
        cache.index.device_stored(plan.admitted)
        cache.clock.stamp(req.last_node, cache.root_node)
        if cache.t1 is not None:
            cache.t1.on_admitted(plan.anchor, req.last_node)
        if plan.cpl == 0 and policy.adaptive_extras:
            # A cold prompt (nothing of it cached): its new nodes enter aged, so a one-shot prompt
            # cannot push out reused context; one that comes back is stamped fresh on use.
            # The aging is the adaptive order's alone (``tiered_lru`` keeps the last use): once
            # the real cache follows a fixed order, the tree's ticks are lru's again (``unage``).
            n, old = req.last_node, policy.tick - policy.cold_age()
            while n is not cache.root_node and not is_reused(n.hit_count):
                n.tiered_tick = old
                n.tiered_cold = True
                n = n.parent
            cache.eviction.diverged = True
