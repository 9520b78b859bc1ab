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
the counter it added, ``unconverged_checks``, is left out of a snapshot where it is 0). The
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
    ("mooncake", 0.005): ("ae56d2d95201cc7b", "4b2f6dd8d9577047"),
    ("mooncake", 0.02): ("9dfcdbe2430350b3", "3febeb543074c54a"),
    ("multitenant", 0.01): ("5a122ec50593c666", "77d0600834d3c176"),
    ("multitenant", 0.1): ("79db1af18739228d", "ca386fa59df1a9d6"),
    ("family-8", 0.005): ("d8ae1c56582d9677", "ac26b758ed58c533"),
    ("family-8", 0.05): ("457e46a11dcf7542", "34eb9eeac9e6269a"),
    ("family-8", 0.2): ("40b42a8024fad50a", "cfe2e58e2b787543"),
    ("family-14", 0.005): ("17c070d8215caf9a", "8dbbaf9e0d461fad"),
    ("family-14", 0.05): ("042c54ab27cb2f79", "b5c82191a014fbad"),
    ("family-14", 0.2): ("fcb03ba4986d8fda", "c43f36bd627e4494"),
    ("family-19", 0.005): ("9753a2a9cf8957e8", "f44e1039d0123ccf"),
    ("family-19", 0.05): ("53a5f0a671be65bb", "02c56e6a15d76fb5"),
    ("family-19", 0.2): ("98fd27a1792e2fd4", "7cd8b85c3bcd42dc"),
    ("family-21", 0.005): ("22bba763146b92de", "774419ffcab26a7a"),
    ("family-21", 0.05): ("1e2982503cc263c1", "376bff572a18aea5"),
    ("family-21", 0.2): ("6b6715cfa7e3fad4", "3f4f6b7cf9f247a9"),
    ("family-25", 0.005): ("6128c52f2452d3b5", "84c9995c08b7621c"),
    ("family-25", 0.05): ("4c2c58975cfbd953", "7465f2a545836d45"),
    ("family-25", 0.2): ("6b6abe1877b8c062", "cd1aaa4a598d133e"),
    ("family-28", 0.005): ("bcaf58063b0a2332", "cae8e35ba80cc7a1"),
    ("family-28", 0.05): ("cfdfdbafca2c3d2e", "159fa19451fdb053"),
    ("family-28", 0.2): ("eb669d6bd15d9f14", "f187a0cb06422a4c"),
}
# the budget mode (``SGLANG_TIERED_GUARANTEE=budget``, ``guard_div_cap=False``): the default's digests
# before session 15, unchanged
BUDGET_RECORDED = {
    ("mooncake", 0.005): ("c6a915b2b104d6cf", "d3fc11713a891885"),
    ("mooncake", 0.02): ("9dfcdbe2430350b3", "a382d46506f708c7"),
    ("multitenant", 0.01): ("5a122ec50593c666", "d58ad3cdc0e2b279"),
    ("multitenant", 0.1): ("79db1af18739228d", "51f6ed4958f92a2b"),
    ("family-8", 0.005): ("d8ae1c56582d9677", "2d65f9b78911bd62"),
    ("family-8", 0.05): ("457e46a11dcf7542", "6efbab2fa3c7da45"),
    ("family-8", 0.2): ("40b42a8024fad50a", "ca1ca991ca1149e4"),
    ("family-14", 0.005): ("098f9b1a4d03bba7", "536275af8b1de1f6"),
    ("family-14", 0.05): ("042c54ab27cb2f79", "cea60d8b5c690f5d"),
    ("family-14", 0.2): ("fcb03ba4986d8fda", "a0a42c979c15a5c1"),
    ("family-19", 0.005): ("9753a2a9cf8957e8", "b04c634fcb58625d"),
    ("family-19", 0.05): ("53a5f0a671be65bb", "446b4e193d49e6d5"),
    ("family-19", 0.2): ("98fd27a1792e2fd4", "d8d4967ea1a0ab67"),
    ("family-21", 0.005): ("22bba763146b92de", "3638f7342bd7cd53"),
    ("family-21", 0.05): ("1e2982503cc263c1", "05eade2e78099902"),
    ("family-21", 0.2): ("6b6715cfa7e3fad4", "6c21a9f4c5da1ce9"),
    ("family-25", 0.005): ("6128c52f2452d3b5", "389e473c1ee1c323"),
    ("family-25", 0.05): ("4c2c58975cfbd953", "09152f0c0bb543b8"),
    ("family-25", 0.2): ("6b6abe1877b8c062", "950907696768849e"),
    ("family-28", 0.005): ("bcaf58063b0a2332", "e362c6c688890a67"),
    ("family-28", 0.05): ("cfdfdbafca2c3d2e", "71e4437a86665f17"),
    ("family-28", 0.2): ("eb669d6bd15d9f14", "be1e3ae0917f609c"),
}


def test_digest_cells_match_the_benchmark():
    from bookkeeping import DIGEST_CELLS

    assert sorted(DIGEST_CELLS) == sorted(RECORDED) == sorted(BUDGET_RECORDED)


# each recorded cell, at the default (strict) and in the budget mode
CASES = [(cell, None, RECORDED) for cell in RECORDED] + [(cell, "budget", BUDGET_RECORDED) for cell in BUDGET_RECORDED]


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
