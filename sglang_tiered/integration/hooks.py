"""SGLang hooks (HookRegistry) that carry the control plane, without new IPC types.

Scheduler processes:
  * AFTER ``SchedulerInternalStateController.get_internal_state``: adds ``internal_state
    ["sglang_tiered"]`` = the tree's per-rank stats (msgpack-safe), read by ``GET /cache/stats``.
  * AFTER ``SchedulerInternalStateController._update_handlers``: adds numeric update keys
    ``protocol.INVALIDATE_KEYS`` (SGLang's set_internal_state carries numbers only, so names
    travel as 62-bit hashes) that run ``TieredRadixCache.invalidate``.
HTTP (launcher) process:
  * BEFORE ``http_server._setup_and_run_http_server``: mounts ``/cache/stats`` and
    ``/cache/invalidate`` and the request-hint middleware before uvicorn starts (and before SGLang
    adds its API-key middleware, which then sees our routes' auth levels).
"""

from __future__ import annotations

import logging
import multiprocessing

from sglang_tiered.integration.protocol import INVALIDATE_KEYS, STATE_KEY

logger = logging.getLogger("sglang_tiered")

_INTERNAL = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
_HTTP = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"


def _tiered_cache(controller):
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    cache = getattr(getattr(controller, "scheduler", None), "tree_cache", None)
    return cache if isinstance(cache, TieredRadixCache) else None


def _after_get_internal_state(result, controller, *args, **kwargs):
    cache = _tiered_cache(controller)
    if cache is not None:
        result.internal_state[STATE_KEY] = cache.stats_snapshot()
    return result


def _after_update_handlers(handlers, controller, *args, **kwargs):
    from sglang.srt.managers.scheduler_components.internal_state import _UpdateHandler

    cache = _tiered_cache(controller)
    if cache is None:
        return handlers

    def validate(key, value):
        from sglang.srt.managers.scheduler_components.internal_state import UpdateRejected

        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UpdateRejected(f"{key} takes a non-negative integer")

    def apply(key, value):
        cache.apply_invalidation_key(key, int(value))
        return None  # nothing goes into the config override

    for key in INVALIDATE_KEYS:
        handlers[key] = _UpdateHandler(validate, apply)
    return handlers


def _before_http_server(*args, **kwargs):
    from sglang_tiered.config import load_config
    from sglang_tiered.integration.http import install

    server_args = args[0] if args else kwargs.get("server_args")
    workers = int(getattr(server_args, "tokenizer_worker_num", 1) or 1)
    if workers > 1:
        # Extra tokenizer workers re-import SGLang's app without our middleware and routes.
        msg = ("sglang-tiered: --tokenizer-worker-num > 1 serves HTTP from worker processes that do "
               "not carry the tenant-header middleware or /cache/* routes")  # fmt: skip
        if load_config().tenant_header:
            logger.error("%s; refusing to start with SGLANG_TIERED_TENANT_HEADER set (tenant isolation would be off)", msg)
            raise SystemExit(2)
        logger.warning(msg)
    install()
    return None


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if multiprocessing.current_process().name == "MainProcess":
        HookRegistry.register(_HTTP, _before_http_server, HookType.BEFORE)
    else:
        HookRegistry.register(f"{_INTERNAL}.get_internal_state", _after_get_internal_state, HookType.AFTER)
        HookRegistry.register(f"{_INTERNAL}._update_handlers", _after_update_handlers, HookType.AFTER)
