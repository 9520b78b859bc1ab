"""SGLang hooks (HookRegistry) that carry the control plane, without new IPC types.

Scheduler processes:
  * AFTER ``SchedulerInternalStateController.get_internal_state``: adds ``internal_state
    ["sglang_tiered"]`` = the tree's per-rank stats (msgpack-safe), read by ``GET /cache/stats``.
  * AFTER ``SchedulerInternalStateController._update_handlers``: adds numeric update keys
    ``protocol.INVALIDATE_KEYS`` (SGLang's set_internal_state carries numbers only, so names
    travel as 62-bit hashes) that run ``TieredRadixCache.invalidate``, and ``PERSIST_KEY`` (= 1)
    that runs ``TieredRadixCache.persist_to_host`` (the device tree into T1 without emptying
    it, as ``/flush_cache`` does first). SGLang's own
    ``POST /set_internal_state {"server_args": {"sglang_tiered_persist_to_host": 1}}`` sends it.
  * AROUND every ``SchedulerWeightUpdaterManager`` method that changes the served weights
    (``update_weights_from_disk/_distributed/_tensor/_ipc``, weight_updater.py:138-290, and
    ``end_weight_update``, :338-349, which finalises weights written by P2P/RDMA without a load
    call) and AFTER ``Scheduler.record_weight_version_change`` (scheduler.py:5636, also behind
    ``/update_weight_version``): ``TieredRadixCache.on_weights_updated`` drops T1 and re-seeds
    the cache identity, whether the call succeeded or not (a failed load may leave the weights
    half updated), so no KV of the old weights is served from T1 or T2 afterwards.
  * BEFORE ``SchedulerWeightUpdaterManager.begin_weight_update`` (weight_updater.py:309): the
    weights change from there until ``end_weight_update`` without a load call to hook;
    ``TieredRadixCache.on_weight_session_begin`` pauses T1/T2 and refuses in-flight KV until
    then (review, session 22).
  * BEFORE ``SchedulerWeightUpdaterManager.release_memory_occupation`` (with the KV cache among
    its tags) and AFTER ``resume_memory_occupation``: SGLang pauses the KV pool and then flushes
    the cache (weight_updater.py:365-366); the cache is told first, cancels its pending T1
    writes while the pool is still readable, and its flush drops the device tree instead of
    demoting pages from unmapped memory (``TieredRadixCache.kv_released``).
  * AFTER ``Sampler._preprocess_logits`` (sampler.py:139, the last step before softmax and
    sampling), when the backend is ours and the batch has a grammar: a row whose every logit is
    ``-inf`` (a grammar that allows no token, ``root ::= root``, or one that allows only EOS while
    ``min_new_tokens`` masks it) gets logit 0 at token 0, the token stock SGLang's greedy path
    picks for such a row. Stock SGLang's top-p/top-k/min-p sampling draws from the row's NaN
    probabilities and ``torch.multinomial`` kills the scheduler (sampler.py:838); now the grammar
    refuses token 0 and SGLang aborts that request alone ("Grammar accept_token failed",
    batch_result_processor.py:722), as its greedy path already did (session 28).
  * AROUND ``BaseGrammarBackend.set_cache`` (base_grammar_backend.py:315), when the backend is
    ours: a grammar whose compile timed out is not cached as invalid. SGLang caches the timeout
    under the grammar's key for good (grammar_manager.py:319-327), so a grammar that timed out only
    because slow compiles of other requests filled the pool (``{"regex": "ab"}``) was refused to
    every later request, of every tenant, until a flush (a helper's hunt, session 28; stock too).
Launcher process (which also runs SGLang's tokenizer manager and HTTP server):
  * BEFORE ``TokenizerManager._validate_one_request``, when the backend is ours: a prompt with no
    tokens after tokenization, or a ``top_k`` past int32, gets a 400 (stock SGLang's scheduler
    dies on either).
  * BEFORE ``ServerArgs.check_server_args`` (engine.py ``_launch_subprocesses``, before any
    scheduler starts), when the backend is ours: ``config.check_server_args``, the options
    SGLang's own arguments make unusable (a named T1 with ``--dp-size``/``--pp-size`` > 1, T2 with
    TP or PP > 1, a tenant header with extra tokenizer workers) stop the launch (exit code 2).
  * BEFORE ``http_server._setup_and_run_http_server``: mounts ``/cache/stats`` and
    ``/cache/invalidate`` and the request-hint middleware before uvicorn starts (and before SGLang
    adds its API-key middleware, which then sees our routes' auth levels).
"""

from __future__ import annotations

import logging
import multiprocessing
import sys

from sglang_tiered.integration.protocol import BACKEND_NAME, INVALIDATE_KEYS, STATE_KEY

logger = logging.getLogger("sglang_tiered")

_INTERNAL = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
_HTTP = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"
_WEIGHTS = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_SERVER_ARGS_CHECK = "sglang.srt.server_args.ServerArgs.check_server_args"
_VALIDATE_REQUEST = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
_SAMPLER_PREPROCESS = "sglang.srt.layers.sampler.Sampler._preprocess_logits"
_GRAMMAR_SET_CACHE = "sglang.srt.constrained.base_grammar_backend.BaseGrammarBackend.set_cache"
GRAMMAR_TIMEOUT = "Grammar preprocessing timed out"  # grammar_manager.py:325
PERSIST_KEY = "sglang_tiered_persist_to_host"
WEIGHT_UPDATE_METHODS = ("update_weights_from_disk", "update_weights_from_distributed", "update_weights_from_tensor",
                         "update_weights_from_ipc", "end_weight_update")  # fmt: skip


def _tiered_cache(controller):
    """The scheduler's tree cache if it is ours; ``controller`` is a scheduler component (it has
    ``.scheduler``) or the ``Scheduler`` itself."""
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    sched = getattr(controller, "scheduler", None) or controller
    cache = getattr(sched, "tree_cache", None)
    return cache if isinstance(cache, TieredRadixCache) else None


def weight_update_hook(method: str):
    """AROUND hook for ``SchedulerWeightUpdaterManager.<method>``: the weights (may) have changed,
    whatever the call returned or raised."""

    def around(original, manager, *args, **kwargs):
        try:
            return original(manager, *args, **kwargs)
        finally:
            cache = _tiered_cache(manager)
            if cache is not None:
                req = args[0] if args else kwargs.get("recv_req")
                cache.on_weights_updated(getattr(req, "weight_version", None), source=method)

    around.__qualname__ = f"sglang_tiered_{method}"
    return around


def _kv_tags(recv_req) -> bool:
    """Whether a release/resume request covers the KV cache (no tags: every memory type)."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

    tags = getattr(recv_req, "tags", None)
    return not tags or GPU_MEMORY_TYPE_KV_CACHE in tags


def _before_release_memory(manager, *args, **kwargs):
    cache = _tiered_cache(manager)
    if cache is not None and _kv_tags(args[0] if args else kwargs.get("recv_req")):
        if cache.t1 is not None:
            cache.t1.cancel_pending()  # while the pool is still mapped
        cache.kv_released = True
    return None


def _weights_tags(recv_req) -> bool:
    """Whether a release/resume request covers the model weights (no tags: every memory type)."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_WEIGHTS

    tags = getattr(recv_req, "tags", None)
    return not tags or GPU_MEMORY_TYPE_WEIGHTS in tags


def _server_args_of(manager):
    """The server arguments of the scheduler behind ``manager`` (the scheduler's mixin, or one
    holding it as ``scheduler``), else the process's runtime context's; None when neither says."""
    sched = getattr(manager, "scheduler", None) or manager
    sa = getattr(sched, "server_args", None)
    if sa is None:
        try:
            from sglang.srt.runtime_context import get_server_args

            sa = get_server_args()
        except Exception:  # noqa: BLE001 - no context: not known
            return None
    return sa


def _weights_backed_up(manager) -> bool:
    """Whether released weights come back as they were: ``--enable-weights-cpu-backup`` (the
    memory saver copies them to host memory at the release, load_model_utils.py:307). Without it
    the resume maps fresh memory and the weights hold whatever it held until a weight update
    loads them again. Unknown: not backed up (the safe side)."""
    return getattr(_server_args_of(manager), "enable_weights_cpu_backup", False) is True


def _weights_released(manager) -> bool:
    """Whether a release of the weights released them at all: only the memory saver does
    (``--enable-memory-saver``); without it SGLang's adapter is a no-op
    (``_TorchMemorySaverAdapterNoop``: pause and resume do nothing, ``enabled`` False), the weights
    stay mapped and intact through the cycle, and the resume is no weight update (review, session
    41: such a cycle dropped T1 and re-seeded the identity to the server's own, off its fleet's T2
    until a restart). Read from the manager's adapter, else ``server_args.enable_memory_saver``;
    unknown: released (the safe side)."""
    enabled = getattr(getattr(manager, "memory_saver_adapter", None), "enabled", None)
    if isinstance(enabled, bool):
        return enabled
    saver = getattr(_server_args_of(manager), "enable_memory_saver", None)
    return saver if isinstance(saver, bool) else True


def _after_resume_memory(result, manager, *args, **kwargs):
    """The KV pool is mapped again; and weights resumed without a CPU backup are not the weights
    the identity names (fresh memory until the next weight update: the RL sleep/wake cycle). KV a
    request computes in between was kept under the old identity: T2 served it to every server on
    those weights, a named T1 after a restart (a helper's hunt, session 41). The resume is taken
    as a weight update: T1 dropped, the identity re-seeded to this server's own."""
    cache = _tiered_cache(manager)
    req = args[0] if args else kwargs.get("recv_req")
    if cache is not None and _kv_tags(req):
        cache.kv_released = False
    if cache is not None and _weights_tags(req) and _weights_released(manager) and not _weights_backed_up(manager):
        cache.on_weights_updated(source="resume_memory_occupation (weights without a CPU backup)")
    return result


def _before_begin_weight_update(manager, *args, **kwargs):
    cache = _tiered_cache(manager)
    if cache is not None:
        cache.on_weight_session_begin()
    return None


def _after_weight_version_change(result, scheduler, *args, **kwargs):
    new_version = args[0] if args else kwargs.get("new_version")
    cache = _tiered_cache(scheduler)
    if cache is not None and new_version is not None and str(new_version) != cache.weight_version:
        cache.on_weights_updated(new_version, source="weight version change")
    return result


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

    def validate_persist(key, value):
        from sglang.srt.managers.scheduler_components.internal_state import UpdateRejected

        if value != 1 or isinstance(value, bool):
            raise UpdateRejected(f"{key} takes 1")

    def persist(key, value):
        logger.info("sglang-tiered: %d tokens persisted to T1", cache.persist_to_host())
        return None

    handlers[PERSIST_KEY] = _UpdateHandler(validate_persist, persist)
    return handlers


def _before_http_server(*args, **kwargs):
    from sglang_tiered.config import load_config
    from sglang_tiered.integration.http import install

    server_args = args[0] if args else kwargs.get("server_args")
    if getattr(server_args, "radix_cache_backend", None) != BACKEND_NAME:
        # a server that did not ask for the tiered backend is SGLang's own: no routes, no
        # middleware (review, session 23: every stock server got /cache/*, and the middleware's
        # rewrites and refusals)
        return None
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


def _claim_named_host_tier(cfg) -> None:
    """In the launcher: own the named T1 for this server's lifetime (one writer per file), before
    any scheduler starts; a second live server with the same name stops here with exit code 2."""
    import multiprocessing

    if not cfg.host_name or cfg.host_mode == "off":
        return
    from sglang_tiered.config import ConfigError
    from sglang_tiered.tier.host_pool import HostPoolError, acquire_owner, inherited_owner

    if multiprocessing.current_process().name != "MainProcess" or inherited_owner(cfg.host_name):
        return  # a process of this server: schedulers check the launcher's token when they map T1

    try:
        acquire_owner(cfg.host_name, export=True)
    except HostPoolError as exc:
        raise ConfigError(f"SGLANG_TIERED_HOST_NAME={cfg.host_name!r}: {exc}") from None


def _bigram_keys(server_args) -> bool:
    """SGLang keys the radix tree by bigrams for this speculative algorithm (its ``is_eagle``, as
    mem_cache/kv_cache_builder.py passes it to the cache); an unknown name is SGLang's to refuse."""
    from sglang_tiered.integration.host_setup import speculative_algorithm

    algo = speculative_algorithm(server_args)
    return algo is not None and bool(getattr(algo, "is_eagle", lambda: False)())


def _not_full_attention(server_args):
    """Why the model is not one the tiered backend serves (hybrid sliding-window, recurrent-state or
    DSA attention), read from its config before the weights load; None when it is, or when the
    config cannot be read here (the cache factory refuses such a model then, after the load).

    The flags are SGLang's own (mem_cache/kv_cache_builder.py ``build_kv_cache``): its model
    config's ``is_hybrid_swa``, ``uses_ssm_state``, ``is_deepseek_dsa``. A DeepSeek-V4 checkpoint is
    left to the factory: its pool may turn the sliding-window allocator off at run time."""
    try:
        from sglang.srt.configs.model_config import ModelConfig, is_deepseek_dsa
        from sglang.srt.mem_cache.kv_cache_builder import uses_ssm_state

        mc = ModelConfig.from_server_args(server_args)
        archs = list(getattr(mc.hf_config, "architectures", None) or ())
        swa = bool(mc.is_hybrid_swa) and "DeepseekV4ForCausalLM" not in archs
        ssm, dsa = bool(uses_ssm_state(mc)), bool(is_deepseek_dsa(mc.hf_config))
    except Exception as exc:  # an unreadable config is SGLang's to report, with its own message
        logger.debug("sglang-tiered: model config not read before the load (%s)", exc)
        return None
    if not (swa or ssm or dsa):
        return None
    return ("--radix-cache-backend tiered supports full-attention models only "
            f"(hybrid_swa={swa}, hybrid_ssm={ssm}, dsa={dsa}; architectures {archs})")


def _before_check_server_args(server_args, *args, **kwargs):
    """In the launcher, before any scheduler starts, for the tiered backend only: the environment
    (``load_config``, which plugin.register only warns about: a stock server must not stop for
    our variables), SGLang's own arguments, and the named T1's owner lock."""
    from sglang_tiered.config import ConfigError, check_server_args, load_config
    if getattr(server_args, "radix_cache_backend", None) != BACKEND_NAME:
        return None
    from sglang_tiered.integration.host_setup import draft_kv

    try:
        cfg = load_config()
        check_server_args(cfg, server_args, bigram_keys=_bigram_keys(server_args), draft_kv=draft_kv(server_args))
        why = _not_full_attention(server_args)
        if why is not None:
            raise ConfigError(why)
        _claim_named_host_tier(cfg)
    except ConfigError as exc:
        msg = f"sglang-tiered: invalid configuration: {exc}"
        logger.error(msg)
        print(msg, file=sys.stderr, flush=True)
        raise SystemExit(2) from exc
    return None


def _before_validate_one_request(manager, obj, input_ids=None, *args, **kwargs):
    """A prompt with no tokens after tokenization is refused (``ValueError``: SGLang's routes answer
    400). Stock SGLang 0.5.23 checks only an empty ``input_ids`` without ``text``; ``{"text": ""}``
    with a tokenizer that adds no BOS token (or ``"prompt": ["a", ""]`` on ``/v1/completions``)
    reaches the scheduler as a 0-token prompt, which runs a forward over 0 tokens and dies
    (``cannot reshape tensor of 0 elements``): one request takes the server down (session 26,
    checked with the tiny model's tokenizer stripped of its BOS). Called for every prompt of a
    batch too (tokenizer_manager.py:1271 and :1711), on every route. Also a ``top_k`` past SGLang's
    own "whole vocabulary" value (``1 << 30``) or not finite: SGLang checks only its lower bound,
    and one past int32 kills the scheduler (session 26, an extended fuzz of sampling fields)."""
    if getattr(getattr(manager, "server_args", None), "radix_cache_backend", None) != BACKEND_NAME:
        return None  # SGLang's own server: its own behaviour
    from sglang_tiered.integration.http import in_session

    ids = kwargs.get("input_ids", input_ids)
    if (ids is not None and len(ids) == 0 and getattr(obj, "input_embeds", None) is None
            and not in_session(getattr(obj, "session_id", None), getattr(obj, "session_params", None))):  # fmt: skip
        raise ValueError("the prompt has no tokens after tokenization; send at least one token")
    sp = getattr(obj, "sampling_params", None)
    top_k = sp.get("top_k") if isinstance(sp, dict) else None
    if isinstance(top_k, (int, float)) and not isinstance(top_k, bool) and not -1 <= top_k <= TOP_K_ALL:
        # SGLang checks only the lower bound; a top_k past int32 kills its scheduler when the
        # batch's sampling tensors are built (``value cannot be converted to type int32``)
        raise ValueError(f"top_k must be -1 (disable) or in [1, {TOP_K_ALL}], got {top_k}")
    return None


TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k (sampling_params.py:43)

_OURS: list = []  # [whether this scheduler process serves our backend], read once


def _around_grammar_set_cache(original, backend, key, value, *args, **kwargs):
    """Everything is cached as SGLang caches it, except a compile that timed out: that says how
    busy the grammar pool was when the request waited, not what the grammar is. The next request
    with that key compiles it again (a key that is slow on its own times out again)."""
    if getattr(value, "error_message", None) == GRAMMAR_TIMEOUT and _serves_our_backend():
        return None
    return original(backend, key, value, *args, **kwargs)


def _serves_our_backend() -> bool:
    if not _OURS:
        try:
            from sglang.srt.runtime_context import get_server_args

            args = get_server_args()
        except Exception:  # noqa: BLE001 - no context yet: decide on a later call
            return False
        if args is None:
            return False
        _OURS.append(getattr(args, "radix_cache_backend", None) == BACKEND_NAME)
    return _OURS[0]


def _after_sampler_preprocess(logits, sampler, *args, **kwargs):
    """A row with no token left (every logit ``-inf`` after the grammar mask and the penalizers)
    gets logit 0 at token 0, so its probabilities are not NaN: stock SGLang 0.5.23's sampling
    kills the scheduler on them (``torch.multinomial``, sampler.py:838, or garbage ids from the
    GPU kernels); the grammar then refuses token 0 and SGLang aborts that request alone, as its
    greedy path (argmax of an all ``-inf`` row is 0) already does. Only batches with a grammar
    (``sampling_info.grammars``, forward_batch_info.py:1006; SGLang drops the applied mask itself,
    model_runner.py:2100) are checked: ``-inf`` comes from the grammar mask (our middleware refuses
    a non-finite logit_bias). On the device, without a host sync."""
    info = args[1] if len(args) > 1 else kwargs.get("sampling_info")
    if not getattr(info, "grammars", None) or logits.dim() != 2 or not _serves_our_backend():
        return None
    import torch

    dead = torch.isneginf(logits).all(dim=-1)
    logits[:, 0].masked_fill_(dead, 0.0)
    return None


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if multiprocessing.current_process().name == "MainProcess":
        HookRegistry.register(_HTTP, _before_http_server, HookType.BEFORE)
        HookRegistry.register(_SERVER_ARGS_CHECK, _before_check_server_args, HookType.BEFORE)
        HookRegistry.register(_VALIDATE_REQUEST, _before_validate_one_request, HookType.BEFORE)
    else:
        HookRegistry.register(f"{_INTERNAL}.get_internal_state", _after_get_internal_state, HookType.AFTER)
        HookRegistry.register(f"{_INTERNAL}._update_handlers", _after_update_handlers, HookType.AFTER)
        for method in WEIGHT_UPDATE_METHODS:
            HookRegistry.register(f"{_WEIGHTS}.{method}", weight_update_hook(method), HookType.AROUND)
        HookRegistry.register(f"{_SCHEDULER}.record_weight_version_change", _after_weight_version_change,
                              HookType.AFTER)  # fmt: skip
        HookRegistry.register(f"{_WEIGHTS}.begin_weight_update", _before_begin_weight_update, HookType.BEFORE)
        HookRegistry.register(f"{_WEIGHTS}.release_memory_occupation", _before_release_memory, HookType.BEFORE)
        HookRegistry.register(f"{_WEIGHTS}.resume_memory_occupation", _after_resume_memory, HookType.AFTER)
        HookRegistry.register(_SAMPLER_PREPROCESS, _after_sampler_preprocess, HookType.AFTER)
        HookRegistry.register(_GRAMMAR_SET_CACHE, _around_grammar_set_cache, HookType.AROUND)
        missing = missing_weight_hook_targets()
        if missing:  # HookRegistry logs and skips a target it cannot resolve: say what that costs
            logger.error("sglang-tiered: cannot hook %s: after a weight update (or a release of the KV pool) T1/T2 "
                         "could serve KV of the old weights (or of released memory); run with SGLANG_TIERED_HOST=off",
                         ", ".join(missing))  # fmt: skip
        if not hook_resolves(_SAMPLER_PREPROCESS):
            logger.error("sglang-tiered: cannot hook %s: a grammar that allows no token can kill the scheduler "
                         "under top-p/top-k/min-p sampling, as in stock SGLang", _SAMPLER_PREPROCESS)  # fmt: skip
        if not hook_resolves(_GRAMMAR_SET_CACHE):
            logger.error("sglang-tiered: cannot hook %s: a grammar compile that timed out is cached as invalid "
                         "for good, as in stock SGLang", _GRAMMAR_SET_CACHE)  # fmt: skip


def hook_resolves(target: str) -> bool:
    """Whether the installed SGLang has ``target`` (a function or method; True on 0.5.23 for the
    sampler and grammar-cache hooks)."""
    import pkgutil

    try:
        return callable(pkgutil.resolve_name(target))
    except Exception:  # noqa: BLE001 - report, never fail the plugin here
        return False


def missing_weight_hook_targets() -> list:
    """The weight-update hook targets the installed SGLang lacks (empty on 0.5.23)."""
    memory = ("begin_weight_update", "release_memory_occupation", "resume_memory_occupation")
    targets = [f"{_WEIGHTS}.{m}" for m in WEIGHT_UPDATE_METHODS + memory]
    return [t for t in targets + [f"{_SCHEDULER}.record_weight_version_change"] if not hook_resolves(t)]
