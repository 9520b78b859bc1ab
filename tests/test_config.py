"""``TieredConfig``: frozen, validated on construction, documented, and the only reader of the
environment (an AST walk of the package)."""

from __future__ import annotations

import ast
import pathlib

import msgspec
import pytest

from sglang_tiered.config import ENV, ConfigError, TieredConfig, load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Reading the environment outside config.py, each for a stated reason (config.py's docstring):
ENV_READERS = {
    "sglang_tiered/config.py",
    "sglang_tiered/tier/host_pool.py",  # SGLANG_TIERED_T1_OWNER: launcher -> scheduler ownership token
    "sglang_tiered/client.py",  # the client library's KV_CACHE_* knobs, in the client's process
    "sglang_tiered/dev/server.py",  # passes the environment on to the server processes it starts
    "sglang_tiered/core/keys.py",  # SGLANG_TIERED_PURE_PYTHON: the C extensions' reference paths (sessions 41, 42)
    # Mooncake's own MC_* names, set around the store client's setup only, an operator's own kept (session 42)
    "sglang_tiered/tier/t2_client.py",
    "kernels/kv_pages.py",  # TRITON_INTERPRET: Triton's own switch, read as Triton reads it (session 41)
}


def test_defaults_are_valid_and_frozen():
    cfg = TieredConfig()
    assert cfg == load_config({})
    with pytest.raises(AttributeError):
        cfg.host_mode = "on"  # type: ignore[misc]
    assert msgspec.to_builtins(cfg)["store"] == "async"


@pytest.mark.parametrize("field,value", [
    ("host_mode", "maybe"), ("host_ratio", 0.0), ("host_ratio", float("nan")), ("host_gb", -1.0),
    ("host_name", "../etc"), ("tenant_header", "x y"), ("store", "later"), ("store_queue_pages", 0),
    ("index_ttl_s", 0.5), ("server_id", "a b"), ("prefix_attention", "yes"),
])  # fmt: skip
def test_construction_validates_and_names_the_variable(field, value):
    with pytest.raises(ConfigError, match=ENV[field]):
        TieredConfig(**{field: value})


def test_prefix_attention_parses_on_off_only():
    assert load_config({ENV["prefix_attention"]: "on"}).prefix_attention
    assert not load_config({ENV["prefix_attention"]: "OFF"}).prefix_attention
    with pytest.raises(ConfigError, match=ENV["prefix_attention"]):
        load_config({ENV["prefix_attention"]: "1"})


def test_every_field_has_a_variable_and_a_comment():
    src = (ROOT / "sglang_tiered" / "config.py").read_text().splitlines()
    for field in TieredConfig.__struct_fields__:
        assert field in ENV, field
        (line,) = [i for i, s in enumerate(src) if s.startswith(f"    {field}:")]
        assert src[line - 1].strip().startswith("#"), f"{field}: document unit, default and sizing above it"


def test_only_config_reads_the_environment():
    readers = set()
    # kernels/ ships as sglang_tiered.kernels: part of the package (it was left out of this walk
    # before session 41, and read TRITON_INTERPRET unlisted)
    for p in [*(ROOT / "sglang_tiered").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]:
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv") and getattr(n.value, "id", "") == "os":
                readers.add(str(p.relative_to(ROOT)))
    assert readers <= ENV_READERS, sorted(readers - ENV_READERS)


def test_stats_schema_covers_what_ranks_send():
    """One schema per concept: the rank snapshot's tenant counters and policy fields are exactly
    the stats Structs' (no hand-kept list to fall out of step)."""
    import dataclasses

    from sglang_tiered.core.policy import AdaptivePolicy
    from sglang_tiered.core.tenants import TenantCounters
    from sglang_tiered.stats import PolicyReport, TenantStats

    counters = {f.name for f in dataclasses.fields(TenantCounters)}
    assert counters == set(TenantStats.__struct_fields__) - {"token_hit_rate", "request_hit_rate"}
    assert set(PolicyReport.__struct_fields__) <= set(AdaptivePolicy(64).snapshot())


@pytest.mark.parametrize("name,near", [
    ("SGLANG_TIERED_HOST_GBS", "SGLANG_TIERED_HOST_GB"), ("SGLANG_TIERED_GUARANTE", "SGLANG_TIERED_GUARANTEE"),
    ("SGLANG_TIERED_TENANT_HEADERS", "SGLANG_TIERED_TENANT_HEADER"), ("SGLANG_TIERED_WHATEVER", None),
])  # fmt: skip
def test_a_mistyped_name_stops_the_launch_with_the_nearest_option(name, near):
    """Review, session 18: a mistyped name was ignored, leaving its option at the default."""
    with pytest.raises(ConfigError, match=name) as err:
        load_config({name: "1"})
    assert (f"did you mean {near}?" in str(err.value)) if near else "did you mean" not in str(err.value)
    assert "SGLANG_TIERED_HOST_RATIO" in str(err.value)  # the options are listed


def test_names_read_elsewhere_are_not_refused():
    from sglang_tiered.config import OTHER_NAMES

    assert load_config(dict.fromkeys(OTHER_NAMES, "1")) == TieredConfig()
    assert load_config({"PATH": "/bin", "SGLANG_OTHER": "x", "sglang_tiered_host_gbs": "1"}) == TieredConfig()


@pytest.mark.parametrize("env,named", [
    ({"SGLANG_TIERED_SERVER_ID": "http://127.0.0.1:1"}, "SGLANG_TIERED_SERVER_ID"),
    ({"SGLANG_TIERED_INDEX_TTL_S": "10"}, "SGLANG_TIERED_INDEX_TTL_S"),
    ({"SGLANG_TIERED_STORE": "sync", "SGLANG_TIERED_STORE_QUEUE_PAGES": "64"}, "SGLANG_TIERED_STORE_QUEUE_PAGES"),
    ({"SGLANG_TIERED_HOST": "off", "SGLANG_TIERED_HOST_GB": "1"}, "SGLANG_TIERED_HOST_GB"),
    ({"SGLANG_TIERED_HOST": "OFF", "SGLANG_TIERED_HOST_RATIO": "2"}, "SGLANG_TIERED_HOST_RATIO"),
    ({"SGLANG_TIERED_HOST": "off", "SGLANG_TIERED_HOST_NAME": "t1"}, "SGLANG_TIERED_HOST_NAME"),
    ({"SGLANG_TIERED_HOST_GB": "1", "SGLANG_TIERED_HOST_RATIO": "2"}, "SGLANG_TIERED_HOST_RATIO"),
])  # fmt: skip
def test_an_option_that_does_nothing_in_the_setup_is_refused(env, named):
    with pytest.raises(ConfigError, match=f"{named}=.* does nothing here"):
        load_config(env)


def test_the_same_options_in_a_setup_that_uses_them_are_accepted():
    cfg = load_config({"SGLANG_TIERED_INDEX_URL": "redis://127.0.0.1:6390", "SGLANG_TIERED_SERVER_ID": "s",
                       "SGLANG_TIERED_INDEX_TTL_S": "10", "SGLANG_TIERED_STORE_QUEUE_PAGES": "64",
                       "SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_GB": "1", "SGLANG_TIERED_HOST_NAME": "t1"})  # fmt: skip
    assert (cfg.server_id, cfg.index_ttl_s, cfg.store_queue_pages, cfg.host_gb) == ("s", 10.0, 64, 1.0)
    assert load_config({"SGLANG_TIERED_HOST_RATIO": "2", "SGLANG_TIERED_STORE": "sync"}).host_ratio == 2.0
    assert load_config({"SGLANG_TIERED_SERVER_ID": "", "SGLANG_TIERED_HOST": "off"}) == TieredConfig(host_mode="off")


def _args(**kw):
    import types

    return types.SimpleNamespace(**{"tp_size": 1, "pp_size": 1, "dp_size": 1, "tokenizer_worker_num": 1, **kw})


@pytest.mark.parametrize("env,args,says", [
    ({"SGLANG_TIERED_HOST_NAME": "t1"}, {"dp_size": 2}, "SGLANG_TIERED_HOST_NAME='t1': a named .* --dp-size 2"),
    ({"SGLANG_TIERED_HOST_NAME": "t1"}, {"pp_size": 4}, "--pp-size 4"),
    ({"SGLANG_TIERED_T2": "mooncake://127.0.0.1:50051"}, {"tp_size": 2}, "T2 supports --tp-size 1 only"),
    ({"SGLANG_TIERED_T2": "mooncake://127.0.0.1:50051"}, {"pp_size": 2}, "T2 supports --pp-size 1 only"),
    ({"SGLANG_TIERED_TENANT_HEADER": "x-tenant-id"}, {"tokenizer_worker_num": 2}, "tenant isolation"),
    ({"SGLANG_TIERED_HOST": "on"}, {"pp_size": 2}, "T1 with --pp-size 2 is not supported"),
    # (session 32: the first was ignored without a word, the others stopped a scheduler after the model loaded)
    ({}, {"radix_eviction_policy": "priority", "_radix_eviction_policy_explicitly_set": True},
     "--radix-eviction-policy priority is not supported"),
    ({}, {"radix_eviction_policy": "slru"}, "SGLANG_TIERED_GUARANTEE=leader"),
    ({}, {"enable_hierarchical_cache": True}, "drop --enable-hierarchical-cache"),
    ({}, {"enable_streaming_session": True}, "--enable-streaming-session is not supported"),
])  # fmt: skip
def test_server_args_that_make_an_option_unusable_stop_the_launch(env, args, says):
    """Review, session 18: these were turned off with a warning in every scheduler after the model
    loaded (the launcher check saw the environment only)."""
    from sglang_tiered.config import check_server_args

    with pytest.raises(ConfigError, match=says):
        check_server_args(load_config(env), _args(**args))


def test_server_args_that_leave_the_options_usable_pass():
    from sglang_tiered.config import check_server_args

    check_server_args(load_config({"SGLANG_TIERED_HOST_NAME": "t1"}), _args(tp_size=8))  # TP: one segment, own heads
    check_server_args(load_config({}), _args(dp_size=2, pp_size=2, tp_size=2, tokenizer_worker_num=4))  # auto: T1 off for PP
    check_server_args(load_config({"SGLANG_TIERED_HOST": "off", "SGLANG_TIERED_TENANT_HEADER": "x-t"}), _args(dp_size=2))
    check_server_args(load_config({}), object())  # attributes SGLang lacks count as 1
    check_server_args(load_config({}), _args(radix_eviction_policy="lru", enable_hierarchical_cache=False,
                                             enable_streaming_session=False))  # SGLang's defaults
    # a model's serving default (not the flag: SGLang's Qwen3-VL override) warns, not stops
    check_server_args(load_config({}), _args(radix_eviction_policy="priority", _radix_eviction_policy_explicitly_set=False))


def test_the_launch_check_hook_target_exists_in_this_sglang():
    import pkgutil

    from sglang_tiered.integration import hooks

    cls, _, method = hooks._SERVER_ARGS_CHECK.rpartition(".")
    assert callable(getattr(pkgutil.resolve_name(cls), method))
