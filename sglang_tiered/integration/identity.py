"""Build the ``CacheKey`` of a running server from SGLang's model config and server args."""

from __future__ import annotations

import logging

from sglang_tiered.core.keys import CacheKey, rope_config_hash
from sglang_tiered.weights_digest import weights_digest

logger = logging.getLogger("sglang_tiered")


def cache_key_from_context(ctx) -> CacheKey:
    sa = ctx.server_args
    mc = ctx.model_config
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    model_path = getattr(sa, "model_path", "") or ""
    digest = weights_digest(model_path)
    kv_dtype = str(getattr(sa, "kv_cache_dtype", "auto"))
    if kv_dtype == "auto":
        kv_dtype = f"auto:{getattr(mc, 'dtype', '')}"
    rope = rope_config_hash(
        getattr(hf, "rope_theta", None),
        getattr(hf, "rope_scaling", None),
        getattr(hf, "max_position_embeddings", None),
        getattr(hf, "partial_rotary_factor", None),
    )
    attn = str(getattr(sa, "attention_backend", None) or "auto")
    key = CacheKey(
        tenant="default",
        model_id=str(getattr(sa, "served_model_name", None) or model_path),
        weights_digest=digest,
        kv_dtype=kv_dtype,
        rope_hash=rope,
        attn_impl=attn,
    )
    logger.info("sglang-tiered: cache identity %s", key)
    return key
