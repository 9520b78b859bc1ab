"""Shared fixtures. Server fixtures start real ``sglang.launch_server`` processes on CPU, once per
test session, lazily (a test run that selects none starts none)."""

from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOG_DIR = ROOT / "logs" / "tests"


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from sglang_tiered.dev.tiny_model import build_model

    return str(build_model())


def _start(spec, name: str):
    from sglang_tiered.dev.server import Server

    server = Server(spec, LOG_DIR / f"{name}.log")
    server.start(timeout_s=300)
    return server


@pytest.fixture(scope="session")
def tiered_server(tiny_model_path):
    from sglang_tiered.dev.server import ServerSpec

    # A small device pool (4,096 tokens) so workloads overflow it and eviction + admission run.
    server = _start(
        ServerSpec(model_path=tiny_model_path, backend="tiered", page_size=16, max_total_tokens=4096,
                   extra_args=["--enable-metrics"]),
        "tiered",
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def admin_server(tiny_model_path):
    """Tiered server with SGLang's API keys, a trusted tenant header and the budget guarantee (the
    default is strict: this one checks that the option reaches a live server)."""
    from sglang_tiered.dev.server import ServerSpec

    server = _start(
        ServerSpec(model_path=tiny_model_path, backend="tiered", page_size=16, max_total_tokens=4096,
                   extra_args=["--api-key", "user-key", "--admin-api-key", "admin-key"],
                   env={"SGLANG_TIERED_TENANT_HEADER": "x-tenant-id", "SGLANG_TIERED_GUARANTEE": "budget"}),
        "admin",
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="session")
def reference_server(tiny_model_path):
    """Stock SGLang with --disable-radix-cache: the ground truth for greedy outputs."""
    from sglang_tiered.dev.server import ServerSpec

    server = _start(
        ServerSpec(model_path=tiny_model_path, backend=None, disable_radix_cache=True, page_size=16),
        "reference",
    )
    yield server
    server.stop()


def pytest_configure(config):
    import os

    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
