"""Adaptive admission by set dueling (a mixin of ``AdaptivePolicy``): page-level miniatures
(``core/miniature.py``) that admit everything, admit by TinyLFU, and (the entry gate's yardstick)
follow plain lru, over a hash-sampled 1-in-8 subset of pages (sparser over
``scale_sample_pages``: ``policy.sample_shift``); the real cache filters admissions while the
TinyLFU miniature wins. See the docstring of ``core/policy.py``.
"""

from __future__ import annotations

from sglang_tiered.core.miniature import MiniCache


class AdmissionDuel:
    def _init_admission(self) -> None:
        """The miniatures and their decayed scores."""
        # Set dueling on admission: miniatures over a hash-sampled 1-in-8 subset of pages (1 in
        # 16-256 over scale_sample_pages), each with the capacity sampled as much (SHARDS-style
        # spatial sampling), under the real eviction order.
        self._mini_cap = max(4, self.capacity_pages // (self._duel_mask + 1))
        # the third miniature is plain lru (k = 0): the yardstick adaptive must beat to be followed
        self._minis = [MiniCache(False, self._mini_cap), MiniCache(True, self._mini_cap),
                       MiniCache(False, self._mini_cap)]  # fmt: skip
        self.scores = [0.0, 0.0, 0.0, 0.0]  # decayed hits of all, tinylfu, lru; references
        # decayed sums of squared per-request differences (all - lru, tinylfu - lru): the paired
        # variance of each lead, so the entry gate asks for a lead beyond its own noise
        self._lead_var = [0.0, 0.0]

    def _duel(self, sampled: list[bytes]) -> None:
        """Run the request's sampled pages through both miniatures; score hits with decay."""
        if not sampled:
            return
        est, tick, k = self.sketch.estimate, self.tick, self.k
        all_, lfu, lru = self._minis
        # Like the real tree: a miniature that refuses a page of this request refuses the rest of
        # it too (admission is prefix-consistent), and only the leading run of hits counts (a
        # page past a miss cannot be reused by a radix prefix match). The miniatures share no
        # state (the sketch is not written here), so each takes the request's pages in one call.
        hits_l = lru.run(sampled, tick, 0.0, est)
        hits_a = all_.run(sampled, tick, k, est)
        hits_f = lfu.run(sampled, tick, k, est)
        d = self.cfg.duel_decay ** len(sampled)
        scores = self.scores
        scores[0] = scores[0] * d + hits_a
        scores[1] = scores[1] * d + hits_f
        scores[2] = scores[2] * d + hits_l
        scores[3] = scores[3] * d + len(sampled)
        v = self._lead_var
        v[0] = v[0] * d + (hits_a - hits_l) ** 2
        v[1] = v[1] * d + (hits_f - hits_l) ** 2
        if not all_.full():  # decide once the miniatures are nearly full
            return
        # TinyLFU admission only if its miniature beats admit-everything by ``admit_margin``
        # (page-level miniatures overstate what filtering buys a radix tree, whose deep pages
        # are useless once a parent is gone); hysteresis: leaving needs it to fall below par.
        # Under sustained thrash the policy gets more selective (seed section 8): par suffices.
        margin = 1.0 if (self.filtering or self.thrashing) else self.cfg.admit_margin
        self.mode_index = 1 if scores[1] > scores[0] * margin else 0

    def admit_pages(self, new_hashes: list[bytes], victim_freq: int | None) -> int:
        """How many of a request's new (not yet cached) pages to keep. Prefix-consistent: a
        refusal drops the page and everything after it."""
        n = len(new_hashes)
        admitted = n
        if n and self.filtering and victim_freq is not None:
            # Admit the leading pages whose frequency beats the victim's (TinyLFU), at least the
            # first page if it does.
            # Pages are counted 1 in 4 (plus each request's last page); an uncounted page takes
            # the estimate of the next counted page after it, a lower bound of its own frequency
            # since frequency never grows with depth along a prefix chain.
            # Front to back, one estimate per run of pages that share it (most refusals stop at
            # the first run).
            est, m = self.sketch.estimate, self._sketch_mask
            admitted = 0
            while admitted < n:
                c = admitted  # the counted page (or the last) whose estimate the run takes
                while c < n - 1 and new_hashes[c][0] & m:
                    c += 1
                if est(new_hashes[c]) <= victim_freq:
                    break
                admitted = c + 1
            room = self.div_room()
            if room is not None and admitted < n:
                # the divergence cap: a refused page is one lru's tree holds and the real cache
                # does not (lru admits everything); the request's new pages count as diverged
                # until the real cache stores them, hence room + n
                keep = max(admitted, n - max(0, int(room + n)))
                self.stats.cap_admitted += keep - admitted
                admitted = keep
            if admitted < n:
                self.stats.admissions_refused += 1
        return self._admitted(n, admitted)

    def admit_all(self, n: int) -> int:
        """All ``n`` new pages of a request kept, unfiltered (a forced order admitting everything,
        told page counts only: ``reads_pages``): ``admit_pages``'s counts alone."""
        return self._admitted(n, n)

    def _admitted(self, n: int, admitted: int) -> int:
        self.stats.pages_offered += n
        self.stats.pages_admitted += admitted
        self.stats.pages_rejected += n - admitted
        self._record(stores=admitted)
        return admitted
