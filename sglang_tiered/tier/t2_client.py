"""The store client T2 uses (``MooncakeClient``): the five calls ``tier/t2.py`` makes, over
``mooncake.store.MooncakeDistributedStore``. Any object with the same five calls (``register``,
``exists``, ``put``, ``get``, ``remove_regex``) can stand in for it (tests/test_t2.py uses an
in-process byte store to inject faults)."""

from __future__ import annotations

import torch

from sglang_tiered.tier.t2_config import T2Config


class MooncakeClient:
    """The few calls T2 makes, over ``mooncake.store.MooncakeDistributedStore``. Return codes are
    Mooncake's: ``exists`` 1 / 0 / negative error, ``put`` 0 or negative, ``get`` bytes or negative."""

    def __init__(self, cfg: T2Config):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise RuntimeError(
                "SGLANG_TIERED_T2 needs Mooncake (pip install mooncake-transfer-engine, or "
                f"mooncake-transfer-engine-non-cuda on CPU; it needs libibverbs1): {exc}"
            ) from exc
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(cfg.local_hostname, cfg.metadata, cfg.segment_mb << 20, cfg.buffer_mb << 20,
                              cfg.protocol, cfg.device, cfg.master)  # fmt: skip
        if rc:
            raise RuntimeError(f"Mooncake store setup failed (code {rc}) for master {cfg.master}")

    def register(self, t: torch.Tensor) -> None:
        rc = self.store.register_buffer(t.data_ptr(), t.numel() * t.element_size())
        if rc:
            raise RuntimeError(f"Mooncake register_buffer failed (code {rc})")

    def exists(self, keys: list[str]) -> list[int]:
        return list(self.store.batch_is_exist(keys))

    def put(self, keys, ptrs, sizes) -> list[int]:
        return list(self.store.batch_put_from(keys, ptrs, sizes))

    def get(self, keys, ptrs, sizes) -> list[int]:
        return list(self.store.batch_get_into(keys, ptrs, sizes))

    def remove_regex(self, pattern: str) -> int:
        return int(self.store.remove_by_regex(pattern))

    def close(self) -> None:
        try:
            self.store.close()
        except Exception:  # noqa: BLE001
            pass
