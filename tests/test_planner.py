"""The break-even planner reproduces the seed's numbers (section 6, R1)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from sglang_tiered.core.planner import (
    ModelShape, break_even_bytes_per_s, kv_bytes_per_token, plan, recompute_s_per_token,
)  # fmt: skip

CFG = pathlib.Path(__file__).parent / "data" / "llama-3-70b-config.json"
H100 = 989.5e12


def shape():
    return ModelShape.from_config(json.loads(CFG.read_text()), params=70e9)


def test_seed_numbers():
    m = shape()
    assert kv_bytes_per_token(m, "fp16") == 320 * 1024  # 320 KiB/token, 70B GQA-8 FP16
    assert round(recompute_s_per_token(m, H100, tp=4) * 1e6) == 35  # 35 us/token at TP4
    assert round(break_even_bytes_per_s(m, H100, tp=4) / 1e9, 1) == 9.3
    assert round(break_even_bytes_per_s(m, H100, tp=4, kv_dtype="fp8") / 1e9, 1) == 4.6
    assert round(break_even_bytes_per_s(m, H100, tp=8) / 1e9, 1) == 18.5
    out = plan(m, flops_per_gpu=H100, tp=4, tiers={"nvme": 7.0}, tokens=2000)
    nvme = out["tiers"][0]
    assert round(nvme["recompute_ms"]) == 71 and round(nvme["read_ms"]) == 94
    assert not nvme["wins_latency"]  # why there is no NVMe tier for interactive traffic


def test_params_estimate_from_config_is_close_to_70b():
    est = ModelShape.from_config(json.loads(CFG.read_text())).params
    assert 69e9 < est < 72e9


def test_cli_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "sglang_tiered.cli", "plan", "--model-config", str(CFG),
                          "--params-b", "70", "--gpu", "h100", "--tp", "4"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "327,680" in out and "35.4" in out and "9.3" in out and "nvme" in out


def test_a_null_field_is_an_absent_one():
    """``null`` in config.json (HF writes it for unset fields) is taken as absent, as the check
    above it did; before, it passed the check and was then used (a traceback; session 32)."""
    import pytest

    base = {"num_attention_heads": 8, "hidden_size": 256, "num_hidden_layers": 4}
    nulls = {**base, "num_key_value_heads": None, "intermediate_size": None, "vocab_size": None, "head_dim": None}
    assert ModelShape.from_config(nulls) == ModelShape.from_config(base)
    with pytest.raises(ValueError, match="lacks hidden_size"):
        ModelShape.from_config({**base, "hidden_size": None})
