"""A model the tiered backend cannot serve (hybrid sliding-window, recurrent-state or DSA attention)
is refused in the launcher, before its weights load (session 40). Before, only the cache factory
refused it, in every scheduler after the load: minutes of a big model's load for an error the
config already showed."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("sglang")

from sglang.srt.server_args import ServerArgs  # noqa: E402

from sglang_tiered.dev.tiny_model import build_model  # noqa: E402
from sglang_tiered.integration import hooks  # noqa: E402


def _args(path) -> ServerArgs:
    return ServerArgs(model_path=str(path), device="cpu", radix_cache_backend="tiered")


def _hybrid_copy(tmp_path):
    src = build_model()
    dst = tmp_path / "hybrid"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(is_hybrid_swa=True, sliding_window=64)  # SGLang's opt-in for custom hybrid-SWA models
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_full_attention_model_passes():
    assert hooks._not_full_attention(_args(build_model())) is None


def test_hybrid_model_stops_the_launch_before_the_load(tmp_path, monkeypatch, capsys):
    for name in ("SGLANG_TIERED_HOST", "SGLANG_TIERED_T2_URL"):
        monkeypatch.delenv(name, raising=False)
    args = _args(_hybrid_copy(tmp_path))
    assert "hybrid_swa=True" in hooks._not_full_attention(args)
    with pytest.raises(SystemExit) as exc:
        hooks._before_check_server_args(args)
    assert exc.value.code == 2
    assert "full-attention models only" in capsys.readouterr().err


def test_unreadable_config_is_left_to_sglang(tmp_path):
    # No config here: SGLang reports that itself, with its own message; we must not mask it.
    assert hooks._not_full_attention(_args(tmp_path / "missing")) is None
