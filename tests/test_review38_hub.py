"""A model or LoRA adapter given by hub name is identified by the files SGLang loads (its local
snapshot in the Hugging Face cache), not by its name (session 38, a helper's audit: a repository
updated under the same name kept its identity, so a named T1 kept across the restart, or a
peer's T2, served the old weights' KV). A name that resolves to no local files gets this server's
lifetime (never shared, never kept)."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_tiered.integration.identity import files_digest, loaded_weights_digest, lora_of


def _snapshot(cache, repo: str, sha: str, weights: bytes):
    base = cache / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / sha
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"model_type": "llama"}')
    (snap / "model.safetensors").write_bytes(weights)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(sha)


def _sa(cache, **kw):
    return SimpleNamespace(model_path="org/model", revision=None, download_dir=str(cache), load_format="auto",
                           port=30000, nccl_port=1, lora_paths=None, **kw)  # fmt: skip


def test_a_hub_model_is_identified_by_its_snapshot_files(tmp_path):
    cache = tmp_path / "hub"
    _snapshot(cache, "org/model", "a" * 40, b"old weights")
    old = loaded_weights_digest(_sa(cache))
    assert not old.startswith("name:") and "unresolved" not in old, old
    # the repository moves on (a new commit, refs/main updated): a new identity
    _snapshot(cache, "org/model", "b" * 40, b"new weights")
    new = loaded_weights_digest(_sa(cache))
    assert new != old
    # the same files under another commit: the same identity (content, not the commit's name)
    _snapshot(cache, "org/model", "c" * 40, b"new weights")
    assert loaded_weights_digest(_sa(cache)) == new
    # a pinned revision resolves to its own snapshot
    pinned = _sa(cache)
    pinned.revision = "a" * 40
    assert loaded_weights_digest(pinned) == old


def test_an_unresolved_name_gets_the_servers_lifetime(tmp_path, monkeypatch, caplog):
    sa = _sa(tmp_path / "empty")
    d = files_digest(sa, "org/missing")
    assert "+unresolved:" in d and "resolves to no local files" in caplog.text
    from sglang_tiered.config import LIFETIME_ENV

    monkeypatch.setenv(LIFETIME_ENV, "another-start")
    assert files_digest(sa, "org/missing") != d  # (another start: another identity)


def test_a_hub_adapter_is_identified_by_its_files(tmp_path):
    cache = tmp_path / "hub"
    _snapshot(cache, "org/adapter", "a" * 40, b"adapter v1")
    sa = _sa(cache)
    sa.lora_paths = ["ad=org/adapter"]
    v1 = lora_of(sa)
    _snapshot(cache, "org/adapter", "b" * 40, b"adapter v2")
    assert lora_of(sa) != v1
