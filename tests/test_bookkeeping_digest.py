"""Speed-ups of the cache's bookkeeping must change no decision: every request's hit length (and
the policy's end snapshot) on a spread of cells equals what the code before them gave.

The digests were recorded with ``bench/bookkeeping.py --digests`` on dae6791 (before the
bookkeeping work of issue #11, item 4). A change that *means* to change decisions (the policy's
rules, its defaults) re-records them with that command, and says so in its commit.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

# (workload, capacity fraction) -> (sha256[:16] of per-request cached lengths, of the end snapshot)
RECORDED = {
    ("mooncake", 0.005): ("d1283ba94f30f6c8", "fe2a12b0fbab1cc4"),
    ("mooncake", 0.02): ("17ef02bbba5a4eee", "028e0bedf6791a63"),
    ("multitenant", 0.01): ("92f5a79da7614409", "d0ca90ec0c109750"),
    ("multitenant", 0.1): ("88abcdae47e57c59", "4e187dcad05f1834"),
    ("family-8", 0.005): ("e9f592c983b81df1", "e1b29990d669f15b"),
    ("family-8", 0.05): ("e5ac8349007493a0", "64531590b03f3cb6"),
    ("family-8", 0.2): ("40b42a8024fad50a", "d2d3134bf37e4e71"),
    ("family-14", 0.005): ("48db4e6737ef8de7", "06b38e61e41037db"),
    ("family-14", 0.05): ("697fa0dfb798e682", "2af2bdbd7579f3c3"),
    ("family-14", 0.2): ("fcb03ba4986d8fda", "5ccaf0319b434c4f"),
    ("family-19", 0.005): ("9753a2a9cf8957e8", "e57a2bd644b09aaa"),
    ("family-19", 0.05): ("848c957bfce5c42b", "212cc200423d4019"),
    ("family-19", 0.2): ("98fd27a1792e2fd4", "fc296cdaf9811b84"),
    ("family-21", 0.005): ("4a186e0f90a0120d", "07487f2173fecc18"),
    ("family-21", 0.05): ("5654acc3814559cc", "badc7a1b1ba54d41"),
    ("family-21", 0.2): ("6b6715cfa7e3fad4", "842b6abb9335e49c"),
    ("family-25", 0.005): ("329890b05d680d0f", "d1c407098689216c"),
    ("family-25", 0.05): ("a225d383b89071c6", "6f199884651edc55"),
    ("family-25", 0.2): ("6b6abe1877b8c062", "8b4471fcfca5ec34"),
    ("family-28", 0.005): ("c853e31d393a064b", "4059f116b8ba229f"),
    ("family-28", 0.05): ("2478cf0ccb659a94", "8951b2b516f36b26"),
    ("family-28", 0.2): ("eb669d6bd15d9f14", "0e124fef1b113950"),
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
