"""Speed-ups of the cache's bookkeeping must change no decision: every request's hit length (and
the policy's end snapshot) on a spread of cells equals what the code before them gave.

The digests were recorded with ``bench/bookkeeping.py --digests`` on dae6791 (before the
bookkeeping work of issue #11, item 4), and re-recorded when the safety duel's shadows became
SGLang's own tree (``TreeShadow``) and an episode's budget room became 1 (session 10). A change
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
    ("mooncake", 0.005): ("3ebb876581df3414", "262085141a9c2c09"),
    ("mooncake", 0.02): ("aa2a83670c95dbb9", "14b08b24d40a3646"),
    ("multitenant", 0.01): ("28381a3310c2e3ae", "d4ce1c7586ce6175"),
    ("multitenant", 0.1): ("79db1af18739228d", "9d1fc39baad702c7"),
    ("family-8", 0.005): ("d8ae1c56582d9677", "b436d4af28ec0b39"),
    ("family-8", 0.05): ("457e46a11dcf7542", "83d60545d75550c5"),
    ("family-8", 0.2): ("40b42a8024fad50a", "57337a28d8c714c4"),
    ("family-14", 0.005): ("fd00e1abb33f49f0", "015c431b0241d4d7"),
    ("family-14", 0.05): ("042c54ab27cb2f79", "c33d5b8ec247df1c"),
    ("family-14", 0.2): ("fcb03ba4986d8fda", "5078cffff090e232"),
    ("family-19", 0.005): ("9753a2a9cf8957e8", "c406b3ad1099473c"),
    ("family-19", 0.05): ("53a5f0a671be65bb", "42c7e321c6d884fc"),
    ("family-19", 0.2): ("98fd27a1792e2fd4", "49c2fc66553eb0c9"),
    ("family-21", 0.005): ("22bba763146b92de", "6de5f03c500f1769"),
    ("family-21", 0.05): ("1e2982503cc263c1", "3430afbde625442f"),
    ("family-21", 0.2): ("6b6715cfa7e3fad4", "e5218039516d7e17"),
    ("family-25", 0.005): ("6128c52f2452d3b5", "78639de477d439f4"),
    ("family-25", 0.05): ("4c2c58975cfbd953", "19c2033c09242025"),
    ("family-25", 0.2): ("6b6abe1877b8c062", "59e14339f1ddc865"),
    ("family-28", 0.005): ("bcaf58063b0a2332", "ac46079b1c518a3f"),
    ("family-28", 0.05): ("cfdfdbafca2c3d2e", "c64005e5110c4713"),
    ("family-28", 0.2): ("eb669d6bd15d9f14", "44bdd7520ab70248"),
}


def test_digest_cells_match_the_benchmark():
    from bookkeeping import DIGEST_CELLS

    assert sorted(DIGEST_CELLS) == sorted(RECORDED)


@pytest.mark.parametrize("cell", list(RECORDED), ids=[f"{n}@{f}" for n, f in RECORDED])
def test_replay_decisions_unchanged_by_bookkeeping(cell):
    import warnings

    from bookkeeping import digest

    warnings.filterwarnings("ignore")
    got = digest(*cell)
    hits, snapshot = RECORDED[cell]
    assert got["hits"] == hits, f"{cell}: a request's hit length changed ({got['hit_tokens']} hit tokens)"
    assert got["snapshot"] == snapshot, f"{cell}: the policy's end snapshot changed"
