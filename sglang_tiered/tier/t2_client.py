"""The store client T2 uses (``MooncakeClient``): the five calls ``tier/t2.py`` makes, over
``mooncake.store.MooncakeDistributedStore``. Any object with the same five calls (``register``,
``exists``, ``put``, ``get``, ``remove_regex``) can stand in for it (tests/test_t2.py uses an
in-process byte store to inject faults)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import torch

from sglang_tiered.tier.t2_config import T2Config


# How long a master has to take a store client's setup (``probe_master``, from the child's import of
# Mooncake on): a healthy one answers in well under a second.
MASTER_PROBE_S = 10.0
# The real setup's own bound, for a master that stops between the probe and it (review, session 42:
# the probe passed, and the setup, holding the GIL, retried the stopped master for about 10 minutes).
# Mooncake reads these from the environment when its client is made; an operator's own values win.
SETUP_ENV = {"MC_RPC_TIMEOUT_MS": "5000", "MC_RPC_CONNECT_TIMEOUT_MS": "5000", "MC_STORE_CLIENT_SETUP_RETRIES": "2"}


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
        why = probe_master(cfg, MASTER_PROBE_S)  # (first: setup itself cannot be given a deadline)
        if why:
            raise RuntimeError(f"Mooncake store setup not tried: {why}")
        self.store = MooncakeDistributedStore()
        with _setup_env():
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


@contextlib.contextmanager
def _setup_env():
    """``SETUP_ENV`` in the environment while a store client is set up (those the operator set
    are kept), then the environment as it was."""
    added = {k: v for k, v in SETUP_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


# The probe's child: the real setup (no segment, a small buffer: only the master's answer is
# asked for) and close. No segment (review, session 43): a mounted one is handed out for replicas
# at once, and a child killed before its close unmounted it left a dead peer in the master for
# 10 s, where the server's own first puts then failed (-800). It says "i" once Mooncake is imported and "s" once the master took the
# setup. argv: the T2Config's connection fields.
_PROBE_CHILD = """
import sys
from mooncake.store import MooncakeDistributedStore
print("i", flush=True)
host, metadata, protocol, device, master = sys.argv[1:6]
s = MooncakeDistributedStore()
rc = s.setup(host, metadata, 0, 16 << 20, protocol, device, master)
if rc:
    print(f"setup returned {rc}", file=sys.stderr, flush=True)
    sys.exit(3)
print("s", flush=True)
s.close()
"""
PROBE_START_S = 60.0  # the child's start and import (a loaded machine: not the master's time)


def probe_master(cfg: T2Config, timeout_s: float) -> str | None:
    """None when ``cfg.master`` takes a store client's setup within ``timeout_s``, else why not.

    Run in a child process (review, session 41): ``MooncakeDistributedStore.setup`` holds the GIL
    while it retries a master that accepts and does not answer (a stopped one: 20 tries of 30 s),
    so no deadline in this process can fire and the launch stalled for about 10 minutes. The
    deadline runs from the child's import of Mooncake to the setup's return (Python's start and the
    import took 2-5 s on a loaded 2-core machine: PROBE_START_S); the child is killed past it. Its
    close (the segment unmounted) is waited for as long again, then it is killed too."""
    import select
    import time

    argv = [sys.executable, "-c", _PROBE_CHILD, cfg.local_hostname, cfg.metadata, cfg.protocol, cfg.device, cfg.master]
    try:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 bufsize=0)  # (unbuffered: a line read leaves the next for select)
    except OSError as exc:
        return f"could not run the master probe: {exc}"
    try:
        for mark, limit, late in ((b"i", PROBE_START_S, "did not start"),
                                  (b"s", timeout_s, f"master {cfg.master} did not answer a store setup within {timeout_s:g} s")):  # fmt: skip
            end = time.monotonic() + limit
            while True:
                left = end - time.monotonic()
                if left <= 0 or not select.select([child.stdout], [], [], left)[0]:
                    return f"the master probe {late}" if mark == b"i" else late
                line = child.stdout.readline()
                if not line:  # (exited)
                    child.wait(5)
                    err = child.stderr.read().decode(errors="replace").strip().splitlines()
                    return f"master {cfg.master} refused a store setup ({(err[-1:] or [f'exit {child.returncode}'])[0][:200]})"
                if line.strip() == mark:
                    break
        try:
            child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass  # (it answered the setup; its close is not ours to wait for)
        return None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(5)
        child.stdout.close()
        child.stderr.close()
