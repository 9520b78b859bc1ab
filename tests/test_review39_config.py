"""A helper's audit of the client library and configuration fail-fast (session 39).

Each test failed before its fix:
  * SGLang cache flags the tiered backend does not honour were not refused at launch:
    ``--enable-lmcache`` and ``--enable-flexkv`` were ignored without a word (SGLang's registry
    calls our factory, which builds no LMCache/FlexKV), and ``--enable-session-radix-cache``
    stopped every scheduler after the model loaded (SGLang's ``create_tree_cache`` refuses a tree
    cache that is not its UnifiedRadixCache).
  * ``SGLANG_TIERED_PREFIX_ATTENTION=on`` beside an attention backend other than torch_native
    (on an x86 CPU SGLang picks intel_amx) did nothing, in silence.
  * ``SGLANG_TIERED_STORE`` / ``SGLANG_TIERED_STORE_QUEUE_PAGES`` with ``SGLANG_TIERED_HOST=off``
    (T1 writes without a T1) were taken and ignored.
  * ``sglang-tiered route --max-body-mb 1e308`` (or ``--parse-limit-mb``) was an OverflowError
    traceback.
  * the client policy counted a ``message_history`` given as one string (each character a turn)
    or one message dict (its keys as turns and text) as a history, and a non-text ``role`` was an
    AttributeError; ``KV_CACHE_LAYERING=`` (blank) switched the policy off, while a blank numeric
    knob (and every blank server option) means "unset".
"""

from __future__ import annotations

import types

import pytest

from sglang_tiered.config import ConfigError, check_server_args, load_config


def _args(**kw):
    return types.SimpleNamespace(**{"tp_size": 1, "pp_size": 1, "dp_size": 1, "tokenizer_worker_num": 1, **kw})


@pytest.mark.parametrize("flag,says", [
    ("enable_lmcache", "--enable-lmcache"),
    ("enable_flexkv", "--enable-flexkv"),
    ("enable_session_radix_cache", "--enable-session-radix-cache"),
])  # fmt: skip
def test_cache_flags_the_backend_does_not_honour_stop_the_launch(flag, says):
    with pytest.raises(ConfigError, match=says):
        check_server_args(load_config({}), _args(**{flag: True}))
    check_server_args(load_config({}), _args(**{flag: False}))  # SGLang's default


def test_prefix_attention_beside_another_attention_backend_stops_the_launch():
    env = {"SGLANG_TIERED_PREFIX_ATTENTION": "on"}
    for kw in ({"attention_backend": "intel_amx"}, {"attention_backend": "torch_native",
                                                    "prefill_attention_backend": "triton"}):  # fmt: skip
        with pytest.raises(ConfigError, match="SGLANG_TIERED_PREFIX_ATTENTION"):
            check_server_args(load_config(env), _args(**kw))
    check_server_args(load_config(env), _args(attention_backend="torch_native"))
    check_server_args(load_config(env), _args(attention_backend=None))  # not resolved yet: SGLang's choice
    check_server_args(load_config({}), _args(attention_backend="intel_amx"))  # off: nothing to say


@pytest.mark.parametrize("env,named", [
    ({"SGLANG_TIERED_HOST": "off", "SGLANG_TIERED_STORE_QUEUE_PAGES": "64"}, "SGLANG_TIERED_STORE_QUEUE_PAGES"),
    ({"SGLANG_TIERED_HOST": "off", "SGLANG_TIERED_STORE": "sync"}, "SGLANG_TIERED_STORE"),
])  # fmt: skip
def test_t1_write_options_without_t1_are_refused(env, named):
    with pytest.raises(ConfigError, match=f"{named}=.* does nothing here"):
        load_config(env)


@pytest.mark.parametrize("flag", ["--max-body-mb", "--parse-limit-mb"])
def test_route_huge_body_limits_are_a_message_not_a_traceback(flag, monkeypatch, capsys):
    import aiohttp.web

    from sglang_tiered.cli import main

    monkeypatch.setattr(aiohttp.web, "run_app", lambda *a, **k: None)
    with pytest.raises(SystemExit) as exc:
        main(["route", "--workers", "http://127.0.0.1:9", flag, "1e308"])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_client_history_must_be_a_list_of_messages():
    from sglang_tiered.client import KVCacheLayeringPolicy

    p = KVCacheLayeringPolicy()
    for bad in ("hello there", {"role": "user", "content": "x"}, b"hello"):
        with pytest.raises(TypeError, match="message_history"):
            p.decide(user_prompt="q", message_history=bad)
    # lists, tuples and generators of messages are histories
    hist = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for h in (hist, tuple(hist), iter(hist)):
        assert p.decide(user_prompt="q", message_history=h).signals["history_turns"] == 1


def test_client_role_that_is_not_text_is_a_clear_error():
    from sglang_tiered.client import KVCacheLayeringPolicy

    p = KVCacheLayeringPolicy()
    with pytest.raises(TypeError, match="role"):
        p.decide(user_prompt="q", role=5)
    assert p.decide(user_prompt="q", role=None).signals["reuse_heavy_role"] is False
    assert p.decide(system_prompt="x" * 2100, role="Agent").cache_worthy  # borderline, tipped


def test_client_blank_switch_is_the_default(monkeypatch):
    from sglang_tiered.client import KVCacheLayeringPolicy

    for blank in ("", "  "):
        monkeypatch.setenv("KV_CACHE_LAYERING", blank)
        assert KVCacheLayeringPolicy().enabled  # as a blank numeric knob: unset, the default (on)
    monkeypatch.setenv("KV_CACHE_LAYERING", "off")
    assert not KVCacheLayeringPolicy().enabled


@pytest.mark.parametrize("url,says", [
    ("mooncake://h:5000/some/path", "path"),
    ("mooncake://u:pw@h:5000", "user"),
    ("mooncake://h:5000#frag", "fragment"),
])  # fmt: skip
def test_t2_url_parts_that_would_be_ignored_are_refused(url, says):
    """A path, credentials or a fragment in SGLANG_TIERED_T2 were dropped without a word (the
    master was reached without them)."""
    from sglang_tiered.tier.t2_config import T2ConfigError, parse_t2_url

    with pytest.raises(T2ConfigError, match=says):
        parse_t2_url(url)
    with pytest.raises(ConfigError, match="SGLANG_TIERED_T2"):
        load_config({"SGLANG_TIERED_T2": url})
    assert parse_t2_url("mooncake://h:5000/?mode=on").mode == "on"  # (a bare "/" is no path)
