"""A tenant-header server's page hashes differ from a salt-mode server's (live: hunt/mixed_mode.py:
a server without the header, on the same T2, served header tenant acme's pages to any client whose
cache_salt was "acme"); a salt-mode server's hashes are unchanged."""
from types import SimpleNamespace

from sglang_tiered.core.keys import CacheKey
from sglang_tiered.integration.identity import cache_key_from_context


def _ctx():
    sa = SimpleNamespace(model_path="/m", served_model_name=None, kv_cache_dtype="auto", attention_backend="fa3",
                         revision=None, load_format="auto", json_model_override_args="{}", lora_paths=None,
                         quantization=None, dtype="auto")
    mc = SimpleNamespace(dtype="torch.bfloat16", hf_config=SimpleNamespace(rope_theta=1e4, rope_scaling=None,
                                                                         max_position_embeddings=4096))
    return SimpleNamespace(server_args=sa, model_config=mc)


def test_tenant_header_is_in_the_identity():
    salt = cache_key_from_context(_ctx())
    header = cache_key_from_context(_ctx(), tenant_header="X-Tenant-Id")
    assert salt.tenants is None and header.tenants == "header:x-tenant-id"
    assert salt.namespace_seed("acme", None) != header.namespace_seed("acme", None)
    assert salt.seed() == CacheKey(**{**salt.__dict__}).seed()  # (salt mode: as before)
