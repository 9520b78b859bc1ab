"""Exact weights digest: changes whenever any byte of any weight file changes.

* Every byte of every weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``)
  plus ``config.json`` is hashed (XXH3-128 when ``xxhash`` is installed, else BLAKE2b), files in
  parallel threads, 16 MiB reads. The per-file digests are combined with the relative file names.
* Cost: one read of the checkpoint at disk speed, once. The result per file is memoised under the
  cache folder, keyed by (absolute path, size, mtime_ns, ctime_ns, inode). ``ctime`` cannot be set
  by users and changes on every write, so a modified file is always rehashed; a file replaced by
  a copy with different bytes has a new inode/ctime and is rehashed too.
* A remote model name (not a folder) gets the name itself as digest, marked ``name:``, since no
  bytes are visible; the README says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import threading
from concurrent.futures import ThreadPoolExecutor

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CHUNK = 16 << 20
_lock = threading.Lock()

try:
    import xxhash

    def _hasher():
        return xxhash.xxh3_128()

    ALGO = "xxh3_128"
except ImportError:  # pragma: no cover - xxhash is in our env, but the core must not need it

    def _hasher():
        return hashlib.blake2b(digest_size=16)

    ALGO = "blake2b128"


def _memo_path() -> pathlib.Path:
    from sglang_tiered.config import cache_root

    return cache_root() / "weights-digests.json"


def _file_digest(path: pathlib.Path) -> str:
    h = _hasher()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def weight_files(folder: pathlib.Path) -> list[pathlib.Path]:
    files = [p for p in folder.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
    for name in ("config.json", "adapter_config.json"):  # (a LoRA adapter's rank and scaling)
        cfg = folder / name
        if cfg.exists():
            files.append(cfg)
    return sorted(files)


def weights_digest(model_path: str, threads: int = 4) -> str:
    """Content digest of a model (or LoRA adapter) folder's weight files and config, or of a
    single weights file (a GGUF model given by its file: review, session 18, it used to be its
    path only); ``name:`` + a hash of the name for anything else (a hub name)."""
    folder = pathlib.Path(model_path)
    if folder.is_file():
        files, folder = [folder], folder.parent
    elif folder.is_dir():
        files = weight_files(folder)
    else:
        return "name:" + hashlib.blake2b(str(model_path).encode(), digest_size=16).hexdigest()
    memo_file = _memo_path()
    with _lock:
        try:
            memo = json.loads(memo_file.read_text())
        except (OSError, ValueError):
            memo = {}

    def key_of(p: pathlib.Path) -> str:
        st = p.stat()
        return f"{ALGO}|{p.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"

    keys = {p: key_of(p) for p in files}
    todo = [p for p in files if keys[p] not in memo]
    if todo:
        with ThreadPoolExecutor(max_workers=max(1, threads)) as ex:
            for p, d in zip(todo, ex.map(_file_digest, todo)):
                memo[keys[p]] = d
        with _lock:
            try:
                memo_file.parent.mkdir(parents=True, exist_ok=True)
                tmp = memo_file.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(memo))
                os.replace(tmp, memo_file)
            except OSError:
                pass  # memoisation is an optimisation only
    top = hashlib.blake2b(digest_size=16)
    for p in files:
        top.update(str(p.relative_to(folder)).encode() + b"\0" + memo[keys[p]].encode() + b"\n")
    return f"{ALGO}:{top.hexdigest()}"
