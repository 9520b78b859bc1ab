"""Speed-ups of the cache's bookkeeping must change no decision: every request's hit length (and
the policy's end snapshot) on a spread of cells equals what the code before them gave.

The digests were recorded with ``bench/bookkeeping.py --digests`` on dae6791 (before the
bookkeeping work of issue #11, item 4), and re-recorded when the safety duel's shadows became
SGLang's own tree (``TreeShadow``) and an episode's budget room became 1 (session 10), and when switches were priced (a trial on
a fork of the lru tree before leaving lru, the switch back prepaid; session 11); the end
snapshots only (every hit digest unchanged) when requests shorter than a page began to be
observed (their partial page's slot is replayed in the tree shadows, and counted; session 14);
and when the strict guarantee became the default (session 15: hits changed in mooncake@0.005 and
family-14@0.005, where the cap acted; every snapshot, which now has the cap's counts); and the
end snapshots only when the overshoot the strict bound counts became ``cap_over_kept`` (session
19: every hit digest unchanged; the over-the-cap order changed no recorded cell); and
multitenant@0.01's end snapshot in both modes when the adaptive order's ticks (cold aging, and in
the default also a split's kept tick) began to be set back to lru's on leaving it (session 24: its
LRU-cycle estimate, 14.7 -> 14.2, is measured on lru's ticks; every hit digest unchanged); and
family-14@0.005's (hits and snapshot, the default only) when the divergence cap began to stay on
until the real cache is lru's tree again, pages and nodes (session 38: ``guard_cap_converging``;
the counter it added, ``unconverged_checks``, is left out of a snapshot where it is 0); and
all of them when the policy's page keys stopped being the identity hashes (session 46: a cheap
chain, ``keys.chain_page_keys``, where nothing outside the process reads a page's identity; every
key-sampled estimate moved: every end snapshot changed, and the hits of mooncake@0.005 (hit tokens
249,696 -> 252,640; budget 285,616 -> 294,784) and family-14@0.005 (23,584 -> 23,408; budget
85,216 -> 66,464), the cells where the cap acts; every other hit digest unchanged). The
budget mode's digests are the default's before that, checked with ``guard_div_cap=False``. A change
that *means* to change decisions (the policy's rules, its defaults) re-records them with that
command, and says so in its commit.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

# (workload, capacity fraction) -> (sha256[:16] of per-request cached lengths, of the end snapshot)
RECORDED = {
    ("mooncake", 0.005): ("2644bf9f0e3d0933", "37a717cef527ff35"),
    ("mooncake", 0.02): ("9dfcdbe2430350b3", "cdcb929865a59474"),
    ("multitenant", 0.01): ("5a122ec50593c666", "c9e7a93b3edea46a"),
    ("multitenant", 0.1): ("79db1af18739228d", "3144bc4123d5cf39"),
    ("family-8", 0.005): ("d8ae1c56582d9677", "01238eeedf344e93"),
    ("family-8", 0.05): ("457e46a11dcf7542", "e3d035edb49218a7"),
    ("family-8", 0.2): ("40b42a8024fad50a", "10c6a56e21c5c214"),
    ("family-14", 0.005): ("11d91a179214b241", "63fe2eea9180592b"),
    ("family-14", 0.05): ("042c54ab27cb2f79", "75835cd654cd0c3a"),
    ("family-14", 0.2): ("fcb03ba4986d8fda", "029e37d8479dcaed"),
    ("family-19", 0.005): ("9753a2a9cf8957e8", "d92beb944970500a"),
    ("family-19", 0.05): ("53a5f0a671be65bb", "d4de69b857a64521"),
    ("family-19", 0.2): ("98fd27a1792e2fd4", "26ef58a42ab0ad19"),
    ("family-21", 0.005): ("22bba763146b92de", "54974bafcb4a08d4"),
    ("family-21", 0.05): ("1e2982503cc263c1", "2513e22920bbf5c0"),
    ("family-21", 0.2): ("6b6715cfa7e3fad4", "b96bb31068c09b85"),
    ("family-25", 0.005): ("6128c52f2452d3b5", "9ece44ef25bf9a98"),
    ("family-25", 0.05): ("4c2c58975cfbd953", "1b259843ddf3c470"),
    ("family-25", 0.2): ("6b6abe1877b8c062", "2506fdcba25bbf7c"),
    ("family-28", 0.005): ("bcaf58063b0a2332", "4ec1e7e37e2639a9"),
    ("family-28", 0.05): ("cfdfdbafca2c3d2e", "a137ba923a1fab39"),
    ("family-28", 0.2): ("eb669d6bd15d9f14", "f011e634e205113c"),
}
# the budget mode (``SGLANG_TIERED_GUARANTEE=budget``, ``guard_div_cap=False``): the default's digests
# before session 15, unchanged
BUDGET_RECORDED = {
    ("mooncake", 0.005): ("7ad169d753582329", "5160db1c0b733cfc"),
    ("mooncake", 0.02): ("9dfcdbe2430350b3", "6251f3e9a3cd4e6f"),
    ("multitenant", 0.01): ("5a122ec50593c666", "787ca7a36c2d9327"),
    ("multitenant", 0.1): ("79db1af18739228d", "bced41eea8e60b38"),
    ("family-8", 0.005): ("d8ae1c56582d9677", "54c53ef112e4d34f"),
    ("family-8", 0.05): ("457e46a11dcf7542", "f84477d31c99a539"),
    ("family-8", 0.2): ("40b42a8024fad50a", "5dbf56178181d015"),
    ("family-14", 0.005): ("bd30dee6dbdd3bcd", "1463cf0cf84abf87"),
    ("family-14", 0.05): ("042c54ab27cb2f79", "16f10f56928aa4e1"),
    ("family-14", 0.2): ("fcb03ba4986d8fda", "9bbe4c9326c65473"),
    ("family-19", 0.005): ("9753a2a9cf8957e8", "7d1a7eeb4b461cbd"),
    ("family-19", 0.05): ("53a5f0a671be65bb", "3b34092850179123"),
    ("family-19", 0.2): ("98fd27a1792e2fd4", "2dd0d90b8434acd5"),
    ("family-21", 0.005): ("22bba763146b92de", "9ebb94c9e9d7ab39"),
    ("family-21", 0.05): ("1e2982503cc263c1", "adf2529ee47541d8"),
    ("family-21", 0.2): ("6b6715cfa7e3fad4", "8f4ca8c1119d5253"),
    ("family-25", 0.005): ("6128c52f2452d3b5", "f87a3b79dfb7c399"),
    ("family-25", 0.05): ("4c2c58975cfbd953", "f2996ab6235b7975"),
    ("family-25", 0.2): ("6b6abe1877b8c062", "6ca73a10e0538155"),
    ("family-28", 0.005): ("bcaf58063b0a2332", "98ad5e268a0cb0f4"),
    ("family-28", 0.05): ("cfdfdbafca2c3d2e", "2766f6f74547807c"),
    ("family-28", 0.2): ("eb669d6bd15d9f14", "1d1caab78d0e7c66"),
}


def test_digest_cells_match_the_benchmark():
    from bookkeeping import DIGEST_CELLS

    assert sorted(DIGEST_CELLS) == sorted(RECORDED) == sorted(BUDGET_RECORDED)


# each recorded cell, at the default (strict) and in the budget mode
CASES = [(cell, None, RECORDED) for cell in RECORDED] + [(cell, "budget", BUDGET_RECORDED) for cell in BUDGET_RECORDED]


@pytest.mark.skipif(not __import__("sglang_tiered.core.keys", fromlist=["x"]).POLICY_KEYS,
                    reason="C extension not built: trees key pages by identity hashes (keys.POLICY_KEYS), "
                           "whose sampled estimates differ from the recorded cells'")  # fmt: skip
@pytest.mark.parametrize("cell,mode,recorded", CASES, ids=[f"{n}@{f}{'-' + m if m else ''}" for (n, f), m, _ in CASES])
def test_replay_decisions_unchanged_by_bookkeeping(cell, mode, recorded):
    import warnings

    from bookkeeping import digest

    from sglang_tiered.core.policy import PolicyConfig

    warnings.filterwarnings("ignore")
    got = digest(*cell, PolicyConfig(guard_div_cap=False) if mode == "budget" else None)
    hits, snapshot = recorded[cell]
    assert got["hits"] == hits, f"{cell}: a request's hit length changed ({got['hit_tokens']} hit tokens)"
    assert got["snapshot"] == snapshot, f"{cell}: the policy's end snapshot changed"
