"""The follow-the-leader oracle of bench/workload_family.py: the bound it reports for any cache
that follows the best fixed SGLang order (it switches content for free)."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from workload_family import follow_the_leader  # noqa: E402


def test_follow_the_leader_takes_the_leader_before_each_request():
    per_request = {"lru": [5, 5, 0, 0, 0], "lfu": [0, 0, 9, 9, 9]}
    # lru leads (ties: lru) for requests 0-3 (10 > 9 before request 3), lfu (18 > 10) at request 4
    assert follow_the_leader(per_request) == 5 + 5 + 0 + 0 + 9


def test_follow_the_leader_decay_forgets_an_old_lead():
    per_request = {"lru": [100, 0, 0, 0, 0, 0], "lfu": [0, 10, 10, 10, 10, 10]}
    assert follow_the_leader(per_request) == 100  # never forgotten: lru leads throughout
    # decay 0.5: lru's 100 fades to 12.5 after three requests while lfu's count tends to 20
    assert follow_the_leader(per_request, 0.5) == 100 + 10 + 10


def test_follow_the_leader_never_beats_the_per_request_best():
    per_request = {"lru": [3, 1, 4, 1, 5], "slru": [2, 7, 1, 8, 2], "lfu": [0, 0, 9, 0, 0]}
    best = sum(max(v[i] for v in per_request.values()) for i in range(5))
    for decay in (1.0, 0.99, 0.5):
        assert follow_the_leader(per_request, decay) <= best
