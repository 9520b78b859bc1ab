"""Build the ``CacheKey`` of a running server from SGLang's model config and server args.

Besides the weights digest, the key holds every server argument that changes the KV computed for
the same weights: ``--kv-cache-dtype`` (with ``auto``, the compute dtype), online quantization
(``--quantization``, ``--modelopt-quant``, the KV scales of ``--quantization-param-path``), the
compute dtype itself (always: with an explicit ``--kv-cache-dtype`` the KV dtype alone no longer
shows it) and ``--revision``. A named T1 kept across restarts, or a T2 shared by a fleet, can so
never serve KV computed under other settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib

from sglang_tiered.core.keys import CacheKey, rope_config_hash
from sglang_tiered.weights_digest import weights_digest

logger = logging.getLogger("sglang_tiered")

def _file_tag(path) -> str:
    """A file's content digest (its path when unreadable)."""
    try:
        return "blake2b:" + hashlib.blake2b(pathlib.Path(path).read_bytes(), digest_size=16).hexdigest()
    except OSError:
        return f"path:{path}"


def quantization_of(sa, mc) -> str | None:
    """Online quantization settings that change the KV, or None when there are none."""
    parts = []
    method = getattr(sa, "quantization", None) or getattr(mc, "quantization", None)
    if method:
        parts.append(str(method))
    modelopt = getattr(sa, "modelopt_quant", None)
    if modelopt:
        parts.append("modelopt=" + json.dumps(modelopt, sort_keys=True, default=str))
    scales = getattr(sa, "quantization_param_path", None)
    if scales:
        parts.append("kv_scales=" + _file_tag(scales))
    return "|".join(parts) or None


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
    model_dtype = getattr(mc, "dtype", None)
    revision = getattr(sa, "revision", None)
    key = CacheKey(
        tenant="default",
        model_id=str(getattr(sa, "served_model_name", None) or model_path),
        weights_digest=digest,
        kv_dtype=kv_dtype,
        rope_hash=rope,
        attn_impl=attn,
        quantization=quantization_of(sa, mc),
        model_dtype=str(model_dtype if model_dtype is not None else getattr(sa, "dtype", "auto")),
        revision=str(revision) if revision else None,
    )
    logger.info("sglang-tiered: cache identity %s", key)
    return key
