"""Session 28: a grammar that allows no token (the one server killer session 27 left open).

Stock SGLang 0.5.23 masks every logit of such a row to ``-inf``; with top-p, top-k or min-p its
torch sampler draws from NaN probabilities and ``torch.multinomial`` kills the scheduler
(sampler.py:838). The plugin's AFTER hook on ``Sampler._preprocess_logits`` gives such a row
logit 0 at token 0 (what SGLang's greedy path picks), the grammar refuses it and SGLang aborts that
request alone. The live check is ``test_a_grammar_that_allows_no_token_is_that_requests_error``
in tests/test_e2e_hardening.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sglang_tiered.integration import hooks  # noqa: E402

NEG = float("-inf")


class _Info:
    def __init__(self, grammars):
        self.grammars = grammars


@pytest.fixture
def ours(monkeypatch):
    monkeypatch.setattr(hooks, "_OURS", [True])


def test_a_row_with_no_token_left_gets_token_0_and_the_others_are_untouched(ours):
    logits = torch.randn(3, 10)
    logits[1] = NEG
    logits[2, 3:] = NEG
    before = logits.clone()
    assert hooks._after_sampler_preprocess(logits, None, logits, _Info([object(), object(), None])) is None
    assert logits[1, 0] == 0 and torch.isneginf(logits[1, 1:]).all()
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    # what SGLang's sampler then does with the row: finite probabilities, token 0 drawn
    probs = torch.softmax(logits, dim=-1)
    assert not probs.isnan().any()
    assert torch.multinomial(probs[1:2], 1).item() == 0


def test_a_batch_without_a_grammar_is_not_touched(ours):
    logits = torch.full((2, 5), NEG)
    hooks._after_sampler_preprocess(logits, None, logits, _Info(None))
    assert torch.isneginf(logits).all()
    hooks._after_sampler_preprocess(logits, None, logits, sampling_info=_Info([]))
    assert torch.isneginf(logits).all()


def test_sglangs_own_backend_is_not_touched(monkeypatch):
    monkeypatch.setattr(hooks, "_OURS", [False])
    logits = torch.full((2, 5), NEG)
    hooks._after_sampler_preprocess(logits, None, logits, _Info([object()]))
    assert torch.isneginf(logits).all()


def test_the_backend_is_read_once_and_only_when_known(monkeypatch):
    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(hooks, "_OURS", [])
    monkeypatch.setattr(rc, "get_server_args", lambda: None)
    assert hooks._serves_our_backend() is False and hooks._OURS == []  # not known yet: asked again later

    class Args:
        radix_cache_backend = "tiered"

    monkeypatch.setattr(rc, "get_server_args", lambda: Args())
    assert hooks._serves_our_backend() is True and hooks._OURS == [True]


def test_the_hooked_sampler_method_exists_and_is_wrapped(ours):
    """The target resolves in the installed SGLang (HookRegistry would skip it with a log line), and
    SGLang's HookRegistry, applied as its plugin loader does, runs the hook on a real ``Sampler``
    method: an all ``-inf`` row comes out of ``_preprocess_logits`` with a finite token."""
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    assert hooks.sampler_hook_resolves()
    cls = pkgutil.resolve_name(hooks._SAMPLER_PREPROCESS.rsplit(".", 1)[0])
    wrapped = _wrap_fn(cls._preprocess_logits, hooks._after_sampler_preprocess, HookType.AFTER)

    class Info(_Info):
        has_custom_logit_processor = False

    sampler = object.__new__(cls)  # (no process group needed: _preprocess_logits reads none)
    logits = torch.full((2, 6), NEG)
    logits[0, 2] = 1.0
    out = wrapped(sampler, logits, Info([object(), object()]))
    assert out[1, 0] == 0 and out[0, 2] == 1.0 and torch.isneginf(out[0, [0, 1, 3, 4, 5]]).all()
