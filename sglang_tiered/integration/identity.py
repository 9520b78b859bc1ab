"""Build the ``CacheKey`` of a running server from SGLang's model config and server args.

Besides the weights digest, the key holds every server argument that changes the KV computed for
the same weights: ``--kv-cache-dtype`` (with ``auto``, the compute dtype), online quantization
(``--quantization``, ``--modelopt-quant``, the KV scales of ``--quantization-param-path``), the
compute dtype itself (always: with an explicit ``--kv-cache-dtype`` the KV dtype alone no longer
shows it), ``--revision``, ``--json-model-override-args`` (it can change any layer: norm eps,
activation, ...), the other compute settings of ``compute_of`` (``--model-impl``,
``--enable-deterministic-inference``, ...; session 41) and the files of the ``--lora-paths`` adapters (SGLang names an adapter by its
name and path only, so a retrained adapter at the same path kept its page hashes; review, session
18). A named T1 kept across restarts, or a T2 shared by a fleet, can so never serve KV computed
under other settings.

It also holds the versions of the software that computes the KV (``software_of``: sglang, torch
with its CUDA or ROCm build, sglang-tiered), unless ``SGLANG_TIERED_IDENTITY_VERSIONS=off``. A
new sglang can change a model's implementation or its kernels, and before session 23 a named T1
kept across an upgrade, or T2 during a rolling upgrade, served the old code's KV as the new
code's. The cost: servers of different versions share no pages.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
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
    restore = getattr(sa, "modelopt_checkpoint_restore_path", None)
    if modelopt and restore:
        # ModelOpt quantizes with the scales of this saved checkpoint in place of a calibration
        # (model_loader/loader.py:3690-3692): another checkpoint, other quantized weights. Before
        # session 41 only the method was named (a helper's hunt)
        parts.append("modelopt_restore=" + files_digest(sa, str(restore), what="ModelOpt checkpoint"))
    return "|".join(parts) or None


def model_impl_of(sa, mc) -> str:
    """The model implementation SGLang runs: ``sglang``, ``transformers`` or ``mindspore``, as
    it resolved ``--model-impl`` (``auto`` is SGLang's own code where it has the architecture,
    else Transformers'; model_loader/utils.py:228-238, ``get_resolved_model_impl``). Where the
    model config cannot be resolved here, the flag itself, with ``auto`` taken as SGLang's code
    (the identity it had before session 41)."""
    try:
        from sglang.srt.model_loader.utils import get_resolved_model_impl

        impl = get_resolved_model_impl(mc)
        return str(getattr(impl, "value", impl)).lower()
    except Exception:  # noqa: BLE001 - not a real ModelConfig (tests), or another SGLang
        raw = str(getattr(getattr(sa, "model_impl", None), "value", getattr(sa, "model_impl", None)) or "auto")
        return "sglang" if raw.lower() == "auto" else raw.lower()


def compute_of(sa, mc) -> str | None:
    """Compute settings besides the attention backend (``attention_impl``) that change the KV a
    server computes for the same weights and tokens; None when all are at their defaults (the
    key, and every page hash, is then what it was before session 41). Before, none was in the
    identity, and servers that differ in one shared KV through T2 or a named T1 (a helper's hunt,
    session 41):

    * ``--model-impl``, as resolved: Transformers' modeling code (with its own version: it is not
      in ``software_of``) computes the q/k/v projections, RoPE and norms in place of SGLang's.
    * ``--enable-deterministic-inference``: batch-invariant matmul, norm and softmax kernels
      (model_runner.py:842-846) and fixed attention splits; KV from a peer without it would also
      make the server's output depend on where its cache hit came from, which the mode forbids.
    * ``--rl-on-policy-target``: the training system's numerics (fp32 RMSNorm: layernorm.py:539).
    * ``--enable-tf32-matmul``: float32 matmuls in TF32 (model_runner.py:438).
    * ``--enable-fused-qk-norm-rope``: q/k norm and RoPE of the keys in one fused kernel.
    * ``--triton-attention-reduce-in-fp32``: the triton attention's reduction dtype.
    * ``--mm-attention-backend``, on a multimodal model: the vision encoder computes the image
      embeddings that an image's pad tokens stand for (their ids are a digest of the input)."""
    parts = []
    impl = model_impl_of(sa, mc)
    if impl != "sglang":
        if impl == "transformers":
            from importlib import metadata

            try:
                impl += "@" + metadata.version("transformers")
            except metadata.PackageNotFoundError:
                pass
        parts.append(f"impl={impl}")
    for name, tag in (("enable_deterministic_inference", "deterministic"), ("enable_tf32_matmul", "tf32"),
                      ("enable_fused_qk_norm_rope", "fused-qk-norm-rope"),
                      ("triton_attention_reduce_in_fp32", "triton-reduce-fp32")):  # fmt: skip
        if getattr(sa, name, None) is True:
            parts.append(tag)
    target = getattr(sa, "rl_on_policy_target", None)
    if target:
        parts.append(f"rl={target}")
    mm_attn = getattr(sa, "mm_attention_backend", None)
    if mm_attn and getattr(mc, "is_multimodal", False) is True:
        parts.append(f"mm-attn={mm_attn}")
    return ";".join(parts) or None


def overrides_of(sa) -> str | None:
    """Digest of ``--json-model-override-args`` (None when empty)."""
    raw = getattr(sa, "json_model_override_args", None)
    if not raw or raw in ("{}", {}):
        return None
    try:
        norm = json.dumps(json.loads(raw) if isinstance(raw, str) else raw, sort_keys=True, default=str)
    except ValueError:
        norm = str(raw)
    return "blake2b:" + hashlib.blake2b(norm.encode(), digest_size=16).hexdigest()


def _lora_items(paths):
    """(name, path) of each ``--lora-paths`` entry, whatever form SGLang keeps it in."""
    if not paths:
        return []
    if isinstance(paths, dict):
        return [(str(k), str(v)) for k, v in paths.items()]
    out = []
    for item in paths:
        if hasattr(item, "lora_path"):
            out.append((str(getattr(item, "lora_name", "") or ""), str(item.lora_path)))
        elif isinstance(item, dict):
            out.append((str(item.get("lora_name", "")), str(item.get("lora_path", item.get("path", "")))))
        else:
            name, sep, path = str(item).partition("=")
            out.append((name, path) if sep else (name, name))
    return out


def startup_adapters(sa) -> dict:
    """``{adapter name: SGLang's lora_id}`` of the ``--lora-paths`` adapters, as the scheduler
    knows them (``LoRARef``; their ids are ``uuid5(name, path)``, the same on every server:
    ``LoRARef.deterministic_id``). Published with the identity so that a router hashes a LoRA
    request's pages in the namespace SGLang gives it (extra_key + lora_id). Adapters loaded at
    run time get random ids and are not in it."""
    out = {}
    for item in getattr(sa, "lora_paths", None) or []:
        name, lid = getattr(item, "lora_name", None), getattr(item, "lora_id", None)
        if isinstance(name, str) and isinstance(lid, str) and name and lid:
            out[name] = lid
    return out


def local_weights(path: str, revision=None, download_dir=None) -> str | None:
    """The local folder or file SGLang loads for ``path``: ``path`` itself when it exists, else
    the Hugging Face cache's snapshot of that repository at ``revision`` (looked up offline: the
    scheduler has downloaded it by the time the cache is built); None when neither is found."""
    if not path:
        return None
    if os.path.exists(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=path, revision=revision, cache_dir=download_dir, local_files_only=True)
    except Exception:  # noqa: BLE001 - not a repository id, not in the cache, no huggingface_hub
        return None


def files_digest(sa, path: str, revision=None, what: str = "model") -> str:
    """``weights_digest`` of the files SGLang loads for ``path`` (a folder, a file, or a hub name
    resolved to its local snapshot). A path that resolves to no local files gets this server's
    lifetime: its pages are never shared with another server or kept across a restart. Before
    session 38 a hub name was identified by its name alone, so a model (or adapter) updated on the
    hub under the same name shared its identity with the old one, and a named T1 kept across the
    restart, or a peer's T2, served the old weights' KV (a helper's audit)."""
    local = local_weights(path, revision, getattr(sa, "download_dir", None))
    if local is not None:
        return weights_digest(local)
    logger.warning("sglang-tiered: the %s %s resolves to no local files (not a folder, a file or a cached hub "
                   "snapshot): the cache identity is this server's own (no T2 pages shared, no named-T1 pages "
                   "kept across restarts)", what, path)  # fmt: skip
    return f"{weights_digest(path)}+unresolved:{lifetime_tag(sa)}"


def lora_of(sa) -> str | None:
    """Digest of every startup adapter's files (None without ``--lora-paths``)."""
    items = _lora_items(getattr(sa, "lora_paths", None))
    if not items:
        return None
    parts = sorted(f"{name}={files_digest(sa, path, what='LoRA adapter')}" for name, path in items)
    return "blake2b:" + hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()


def software_of() -> str:
    """The versions of the code that computes KV: ``sglang=..;torch=..;sglang-tiered=..``."""
    from importlib import metadata

    import torch

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "none"

    # torch's own string carries the build (+cu130, +cpu), which the metadata may lack
    return f"sglang={version('sglang')};torch={torch.__version__};sglang-tiered={version('sglang-tiered')}"


# --load-format values that load the weight files weights_digest hashes (the model folder's, or
# the GGUF file given as the model): "auto" leaves the identity as it was, the others are named in
# it (a folder may hold .bin and .safetensors files that differ). Any other format does not load
# those bytes as they are: dummy (random weights), remote / remote_instance / rdma (copied from
# elsewhere, which may have been updated since), sharded_state, bitsandbytes, jax, private, ...
# Its weights have no digest here, so its identity is this server's lifetime: pages are shared
# within it, never with another server (T2) or a restart (named T1). Before, a server on dummy
# weights and one on the folder's weights shared one identity and were served each other's KV
# through T2 and a named T1 (a helper's audit, session 37).
FILE_LOAD_FORMATS = frozenset({"auto", "pt", "safetensors", "npcache", "fastsafetensors", "gguf", "mistral"})


def lifetime_tag(sa) -> str:
    """This server's lifetime: the same on every TP rank (one launcher), unique per start, and
    apart for engines of one process (their ports)."""
    from sglang_tiered.config import lifetime_id

    return f"{lifetime_id()}:{getattr(sa, 'port', '')}:{getattr(sa, 'nccl_port', '')}"


def loaded_weights_digest(sa) -> str:
    """``weights_digest`` of what ``--load-format`` loads (``FILE_LOAD_FORMATS``)."""
    digest = files_digest(sa, getattr(sa, "model_path", "") or "", getattr(sa, "revision", None))
    fmt = str(getattr(getattr(sa, "load_format", None), "value", getattr(sa, "load_format", None)) or "auto")
    if fmt == "auto":
        return digest
    if fmt in FILE_LOAD_FORMATS:
        return f"{digest}+load:{fmt}"
    logger.warning("sglang-tiered: --load-format %s does not load the model's files as they are: the cache "
                   "identity is this server's own (no T2 pages shared, no named-T1 pages kept across restarts)", fmt)  # fmt: skip
    return f"{digest}+load:{fmt}:{lifetime_tag(sa)}"


def attention_impl(sa, prefix_attention: bool = False) -> str:
    """The attention code that computes the KV this server caches: ``--attention-backend``, and
    ``--prefill-attention-backend`` / ``--decode-attention-backend`` where they override it (extend
    writes the prompt's KV, decode the output's, which later requests reuse), and the prefix-aware
    extend of ``SGLANG_TIERED_PREFIX_ATTENTION=on`` (equal to the stock extend up to summation
    order). Before session 39 the overrides were left out: two servers that computed KV with
    different backends shared it through T2 or a named T1."""
    base = str(getattr(sa, "attention_backend", None) or "auto")
    parts = [base]
    for role in ("prefill", "decode"):
        other = getattr(sa, f"{role}_attention_backend", None)
        if other and str(other) != base:
            parts.append(f"{role}:{other}")
    if prefix_attention:
        parts.append("prefix-rows")
    return "+".join(parts)


def cache_key_from_context(ctx, *, versions: bool = True, tenant_header: str | None = None,
                           prefix_attention: bool = False) -> CacheKey:  # fmt: skip
    sa = ctx.server_args
    mc = ctx.model_config
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    model_path = getattr(sa, "model_path", "") or ""
    digest = loaded_weights_digest(sa)
    kv_dtype = str(getattr(sa, "kv_cache_dtype", "auto"))
    if kv_dtype == "auto":
        kv_dtype = f"auto:{getattr(mc, 'dtype', '')}"
    rope = rope_config_hash(
        getattr(hf, "rope_theta", None),
        getattr(hf, "rope_scaling", None),
        getattr(hf, "max_position_embeddings", None),
        getattr(hf, "partial_rotary_factor", None),
    )
    attn = attention_impl(sa, prefix_attention)
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
        model_overrides=overrides_of(sa),
        lora=lora_of(sa),
        software=software_of() if versions else None,
        tenants=f"header:{tenant_header.lower()}" if tenant_header else None,
        compute=compute_of(sa, mc),
    )
    logger.info("sglang-tiered: cache identity %s", key)
    return key
