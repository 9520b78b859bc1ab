"""The built-in tiny model is deterministic, offline, and loadable by transformers' tokenizer."""

from __future__ import annotations

import hashlib
import json

from sglang_tiered.dev.tiny_model import TinyModelSpec, build_model


def _digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_build_is_deterministic_and_cached(tmp_path):
    spec = TinyModelSpec()
    a = build_model(spec, root=tmp_path / "a")
    b = build_model(spec, root=tmp_path / "b")
    assert _digest(a) == _digest(b)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    assert build_model(spec, root=tmp_path / "a") == a  # second call reuses the folder
    cfg = json.loads((a / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (256, 4, 8)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["max_position_embeddings"]) == (4, 32, 4096)


def test_variants_get_their_own_folder(tmp_path):
    base = build_model(TinyModelSpec(), root=tmp_path)
    deep = build_model(TinyModelSpec(num_layers=6, max_position_embeddings=8192), root=tmp_path)
    assert base != deep
    assert json.loads((deep / "config.json").read_text())["num_hidden_layers"] == 6


def test_tokenizer_and_chat_template(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = tok("def hello(world): return 42").input_ids
    assert ids[0] == tok.bos_token_id and len(ids) > 3
    assert max(ids) < 2048
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|start_header_id|>assistant<|end_header_id|>" in text
