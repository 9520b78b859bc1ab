"""Break-even arithmetic for KV tiers (seed section 6, R1): is reading KV from a tier faster and
cheaper than recomputing it?

    kv_bytes_per_token = 2 (K,V) * layers * kv_heads * head_dim * bytes_per_element
    recompute_s_per_token = 2 * params / (flops_per_gpu * tp)           (prefill, compute-bound)
    break_even_bw = kv_bytes_per_token / recompute_s_per_token          (bytes/s)

A tier wins on latency when its bandwidth beats break-even (reading N tokens takes less than
recomputing them). It wins on GPU cost when the GPU time saved (recompute) exceeds the GPU time the
transfer keeps the GPU waiting, i.e. the same comparison per GPU; both are reported.
Pure Python: no torch, no sglang.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KV_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
                  "fp8_e5m2": 1, "int8": 1, "fp32": 4, "float32": 4}  # fmt: skip
GPU_BF16_DENSE_FLOPS = {"h100": 989.5e12, "h200": 989.5e12, "a100": 312e12, "l40s": 362e12, "b200": 2250e12}
DEFAULT_TIERS_GBPS = {"host-pcie5": 50.0, "nvme": 7.0, "network-100g": 12.5}


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    params: float  # parameter count

    @classmethod
    def from_config(cls, cfg: dict, params: float | None = None) -> "ModelShape":
        if not isinstance(cfg, dict):
            raise ValueError("the model config is not a JSON object")
        cfg = cfg.get("text_config", cfg)
        if not isinstance(cfg, dict):
            raise ValueError("the model config's text_config is not a JSON object")
        for name in ("num_attention_heads", "hidden_size", "num_hidden_layers", "num_key_value_heads",
                     "head_dim", "intermediate_size", "vocab_size"):  # fmt: skip
            v = cfg.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                # (a 0 divided, a string raised, a negative printed negative times: review, session 23)
                raise ValueError(f"the model config's {name} must be a whole number >= 1, got {v!r}")
        # null is absent (it passed the check above, then was used: a traceback; session 32)
        cfg = {k: v for k, v in cfg.items() if v is not None}
        missing = [n for n in ("num_attention_heads", "hidden_size", "num_hidden_layers") if n not in cfg]
        if missing:
            raise ValueError(f"the model config lacks {', '.join(missing)}")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // heads
        kv_heads = cfg.get("num_key_value_heads", heads)
        layers = cfg["num_hidden_layers"]
        return cls(layers, kv_heads, head_dim, params if params is not None else estimate_params(cfg))  # (cfg: no nulls)


def estimate_params(cfg: dict) -> float:
    """Dense decoder parameter count from a HF config (attention + gated MLP + embeddings)."""
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    kvh = cfg.get("num_key_value_heads", heads)
    inter = cfg.get("intermediate_size", 4 * h)
    vocab = cfg.get("vocab_size", 0)
    per_layer = h * heads * hd + 2 * h * kvh * hd + heads * hd * h + 3 * h * inter
    emb = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return float(cfg["num_hidden_layers"] * per_layer + emb)


def kv_bytes_per_token(m: ModelShape, kv_dtype: str = "fp16") -> int:
    return 2 * m.layers * m.kv_heads * m.head_dim * KV_DTYPE_BYTES[kv_dtype]


def recompute_s_per_token(m: ModelShape, flops_per_gpu: float, tp: int = 1) -> float:
    return recompute_s_per_token_of(m.params, flops_per_gpu, tp)


def recompute_s_per_token_of(params: float, flops_per_gpu: float, tp: int = 1) -> float:
    """Prefill recompute time of one token: 2 FLOPs per parameter over the TP group's FLOP/s."""
    return 2.0 * params / (flops_per_gpu * tp)


def break_even_bytes_per_s(m: ModelShape, flops_per_gpu: float, tp: int = 1, kv_dtype: str = "fp16") -> float:
    return kv_bytes_per_token(m, kv_dtype) / recompute_s_per_token(m, flops_per_gpu, tp)


@dataclass
class TierVerdict:
    name: str
    bandwidth_gbps: float
    read_ms: float
    recompute_ms: float
    wins_latency: bool
    wins_gpu_cost: bool


def plan(m: ModelShape, *, flops_per_gpu: float, tp: int = 1, kv_dtype: str = "fp16",
         tiers: dict[str, float] | None = None, tokens: int = 2000) -> dict:  # fmt: skip
    """Per-tier verdicts for reading ``tokens`` of KV instead of recomputing them."""
    kvb = kv_bytes_per_token(m, kv_dtype)
    rc = recompute_s_per_token(m, flops_per_gpu, tp)
    be = kvb / rc
    verdicts = []
    for name, gbps in (tiers or DEFAULT_TIERS_GBPS).items():
        read_s = tokens * kvb / (gbps * 1e9)
        recompute_s = tokens * rc
        # GPU cost: a read keeps the GPUs of this TP group waiting read_s; recompute occupies
        # them recompute_s. Same inequality per GPU-second; kept separate for reporting.
        verdicts.append(TierVerdict(name, gbps, read_s * 1e3, recompute_s * 1e3, read_s < recompute_s,
                                    read_s * tp < recompute_s * tp))  # fmt: skip
    return {
        "kv_bytes_per_token": kvb,
        "kv_kib_per_token": kvb / 1024,
        "recompute_us_per_token": rc * 1e6,
        "break_even_gbps": be / 1e9,
        "tokens": tokens,
        "tiers": [v.__dict__ for v in verdicts],
    }


def load_config_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
