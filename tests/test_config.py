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
    for p in (ROOT / "sglang_tiered").rglob("*.py"):
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
