"""Fail fast, and visibly, when the installed SGLang lacks a symbol we rely on.

SGLang swallows plugin exceptions (sglang/srt/plugins/__init__.py:133-136 in 0.5.23), so a broken
plugin would otherwise only surface later as "--radix-cache-backend='tiered' is not registered".
``check_compat`` names the installed and supported versions and every missing symbol.
"""

from __future__ import annotations

import importlib
import logging

from sglang_tiered import SUPPORTED_SGLANG_VERSION

logger = logging.getLogger("sglang_tiered")

# (module, attribute) pairs the integration layer uses.
REQUIRED_SYMBOLS: tuple[tuple[str, str], ...] = (
    ("sglang.srt.mem_cache.registry", "register_radix_cache_backend"),
    ("sglang.srt.mem_cache.registry", "registered_radix_cache_backends"),
    ("sglang.srt.mem_cache.registry", "default_radix_cache_factory"),
    ("sglang.srt.mem_cache.registry", "TreeCacheBuildContext"),
    ("sglang.srt.mem_cache.radix_cache", "RadixCache"),
    ("sglang.srt.mem_cache.radix_cache", "RadixKey"),
    ("sglang.srt.mem_cache.radix_cache", "TreeNode"),
    ("sglang.srt.mem_cache.base_prefix_cache", "MatchPrefixParams"),
    ("sglang.srt.mem_cache.base_prefix_cache", "MatchResult"),
    ("sglang.srt.mem_cache.base_prefix_cache", "InsertParams"),
    ("sglang.srt.mem_cache.base_prefix_cache", "EvictParams"),
    ("sglang.srt.mem_cache.base_prefix_cache", "EvictResult"),
    ("sglang.srt.mem_cache.cache_init_params", "CacheInitParams"),
    ("sglang.srt.utils.common", "ceil_align"),
)

# Methods of RadixCache that TieredRadixCache overrides or calls; a rename upstream must fail here.
REQUIRED_RADIX_METHODS = (
    "checkpoint",
    "evict",
    "match_prefix",
    "insert",
    "reset",
    "inc_lock_ref",
    "dec_lock_ref",
    "_delete_leaf",
    "_update_leaf_status",
    "_insert_helper",
    "_split_node",
    "_match_prefix_helper",  # integration/tree_ops.py re-implements these walks on key offsets
    "_inc_hit_count",
)
# Methods of RadixKey that integration/tree_ops.py calls.
REQUIRED_RADIX_KEY_METHODS = ("child_key_at", "match_at", "raw_token_ids")


class SGLangCompatError(RuntimeError):
    pass


def installed_sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - any failure means "unknown"
        return "unknown"


def missing_symbols(
    symbols: tuple[tuple[str, str], ...] = REQUIRED_SYMBOLS,
    methods: tuple[str, ...] = REQUIRED_RADIX_METHODS,
) -> list[str]:
    missing: list[str] = []
    for mod_name, attr in symbols:
        try:
            mod = importlib.import_module(mod_name)
        except Exception as exc:  # noqa: BLE001 - report, do not crash the check itself
            missing.append(f"{mod_name} (import failed: {exc.__class__.__name__}: {exc})")
            continue
        if not hasattr(mod, attr):
            missing.append(f"{mod_name}.{attr}")
    if methods:
        try:
            from sglang.srt.mem_cache.radix_cache import RadixCache
        except Exception:  # noqa: BLE001 - already reported above
            return missing
        missing += [f"RadixCache.{m}" for m in methods if not hasattr(RadixCache, m)]
        from sglang.srt.mem_cache.radix_cache import RadixKey

        missing += [f"RadixKey.{m}" for m in REQUIRED_RADIX_KEY_METHODS if not hasattr(RadixKey, m)]
    return missing


def check_compat(**kwargs) -> None:
    missing = missing_symbols(**kwargs)
    if missing:
        msg = (
            f"sglang-tiered supports sglang=={SUPPORTED_SGLANG_VERSION}, but sglang "
            f"{installed_sglang_version()} is installed and lacks: {', '.join(missing)}. "
            "The 'tiered' radix cache backend is NOT registered."
        )
        raise SGLangCompatError(msg)
    installed = installed_sglang_version()
    if installed != SUPPORTED_SGLANG_VERSION:
        logger.warning(
            "sglang-tiered is tested with sglang==%s; sglang %s is installed (all required "
            "symbols are present, continuing)",
            SUPPORTED_SGLANG_VERSION,
            installed,
        )
