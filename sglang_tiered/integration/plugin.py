"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``tiered``).

``load_plugins()`` runs this in the launcher, in every scheduler (TP/PP rank), in the DP controller
and in the detokenizer (sglang/srt/plugins/__init__.py:103-141, called e.g. from
launch_server.py:79 and managers/scheduler.py:6323). It is idempotent per process; we also guard
against the registry's duplicate-name ValueError so a second call in one process is harmless.
"""

from __future__ import annotations

import logging
import sys

from sglang_tiered.integration.protocol import BACKEND_NAME

logger = logging.getLogger("sglang_tiered")


def tiered_cache_factory(ctx):
    """Build the tree cache for ``--radix-cache-backend tiered`` from a TreeCacheBuildContext."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    if ctx.disable_radix_cache:
        # --disable-radix-cache wins: SGLang's own disabled cache, nothing for us to manage.
        return default_radix_cache_factory(ctx)
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.is_dsa:
        raise ValueError(
            "--radix-cache-backend tiered supports full-attention models only "
            f"(hybrid_swa={ctx.is_hybrid_swa}, hybrid_ssm={ctx.is_hybrid_ssm}, dsa={ctx.is_dsa})"
        )
    if ctx.enable_hierarchical_cache:
        raise ValueError(
            "--radix-cache-backend tiered brings its own host tier; drop --enable-hierarchical-cache"
        )
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    cache = TieredRadixCache.from_build_context(ctx)
    logger.info("sglang-tiered: built %s", cache.describe())
    return cache


def register() -> None:
    """Entry point: check compatibility, then register the ``tiered`` backend once per process."""
    from sglang_tiered.config import ConfigError, load_config

    # This runs in every SGLang process of a machine where the package is installed, whatever the
    # backend: a bad SGLANG_TIERED_* variable must not stop a stock server (review, session 23).
    # The launch of a tiered server is stopped by the server-args hook (hooks.py), before the
    # model loads, which also takes the named T1's owner lock.
    try:
        cfg = load_config()
    except ConfigError as exc:
        cfg = None
        logger.warning("sglang-tiered: invalid configuration (a --radix-cache-backend tiered launch stops on it): %s", exc)
    from sglang_tiered.config import lifetime_id

    lifetime_id()  # in the launcher: set before any scheduler starts, so all of them inherit it
    try:
        from sglang_tiered.integration.compat import check_compat

        check_compat()
        from sglang.srt.mem_cache.registry import (
            register_radix_cache_backend,
            registered_radix_cache_backends,
        )

        if BACKEND_NAME not in registered_radix_cache_backends():
            register_radix_cache_backend(BACKEND_NAME, tiered_cache_factory)
            from sglang_tiered.integration.hooks import register_hooks

            register_hooks()
        if cfg is not None and cfg.prefix_attention:
            from sglang_tiered.integration.prefix_attention import install

            install()  # (the attention backend it registers serves tiered servers only)
    except Exception as exc:
        # SGLang logs and swallows plugin exceptions; make sure the cause is impossible to miss.
        msg = f"sglang-tiered: plugin registration failed: {exc}"
        logger.error(msg)
        print(msg, file=sys.stderr, flush=True)
        raise
