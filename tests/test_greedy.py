"""``dev.greedy.compare``: the tie-aware differential check used by the server soak."""

from sglang_tiered.dev.greedy import compare


def _out(ids, chosen, tops):
    return {"output_ids": ids, "meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in zip(chosen, ids)],
                                             "output_top_logprobs": [[[lp, t, None] for lp, t in top] for top in tops]}}  # fmt: skip


REF = _out([5, 6], [-1.0, -2.0], [[(-1.0, 5), (-1.00005, 9)], [(-2.0, 6), (-3.0, 7)]])


def test_equal_tokens_and_logprobs():
    assert compare(REF, REF)[0] == "equal"


def test_same_tokens_but_logprobs_off_is_a_difference():
    """Wrong KV can leave the argmax alone; the logprob gives it away."""
    got = _out([5, 6], [-1.0, -2.5], [[(-1.0, 5), (-1.00005, 9)], [(-2.5, 6), (-3.0, 7)]])
    assert compare(REF, got)[0] == "differ"


def test_flip_at_a_near_tie_to_the_runner_up_is_a_tie():
    got = _out([9, 1], [-1.00001, -0.5], [[(-1.00001, 9), (-1.00002, 5)], [(-0.5, 1), (-2.0, 2)]])
    assert compare(REF, got)[0] == "tie"


def test_flip_without_a_near_tie_or_to_another_token_is_a_difference():
    far = _out([6, 6], [-0.1, -2.0], [[(-0.1, 5), (-5.0, 6)], [(-2.0, 6), (-3.0, 7)]])
    ref_far = _out([5, 6], [-0.1, -2.0], [[(-0.1, 5), (-5.0, 6)], [(-2.0, 6), (-3.0, 7)]])
    assert compare(ref_far, far)[0] == "differ"
    other = _out([8, 6], [-1.0, -2.0], [[(-1.0, 8), (-1.00005, 5)], [(-2.0, 6), (-3.0, 7)]])
    assert compare(REF, other)[0] == "differ"
    shifted = _out([9, 1], [-0.9, -0.5], [[(-0.9, 9), (-1.2, 5)], [(-0.5, 1), (-2.0, 2)]])
    assert compare(REF, shifted)[0] == "differ"  # served logits moved, not a tie flip
