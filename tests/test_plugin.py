"""Registration, compat check, and the package layout (no server processes)."""

from __future__ import annotations

import importlib.metadata

import pytest


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    ours = [ep for ep in eps if ep.name == "tiered"]
    assert len(ours) == 1
    assert ours[0].value == "sglang_tiered.integration.plugin:register"


def test_register_is_idempotent():
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends

    from sglang_tiered.integration.plugin import register

    register()
    register()
    assert registered_radix_cache_backends().count("tiered") == 1


def test_sglang_load_plugins_registers_tiered():
    from sglang.srt.mem_cache.registry import get_radix_cache_factory
    from sglang.srt.plugins import load_plugins

    from sglang_tiered.integration.plugin import tiered_cache_factory

    load_plugins()
    assert get_radix_cache_factory("tiered") is tiered_cache_factory


def test_compat_check_passes_on_supported_sglang():
    from sglang_tiered.integration.compat import check_compat, installed_sglang_version

    assert installed_sglang_version() == "0.5.23"
    check_compat()


def test_compat_check_names_versions_and_missing_symbols():
    from sglang_tiered.integration.compat import SGLangCompatError, check_compat

    with pytest.raises(SGLangCompatError) as err:
        check_compat(
            symbols=(("sglang.srt.mem_cache.registry", "no_such_symbol"), ("no_such_module_x", "y")),
            methods=("checkpoint", "no_such_method"),
        )
    msg = str(err.value)
    assert "0.5.23" in msg and "sglang.srt.mem_cache.registry.no_such_symbol" in msg
    assert "no_such_module_x" in msg and "RadixCache.no_such_method" in msg
    assert "NOT registered" in msg


def test_registration_failure_is_logged_and_raised(monkeypatch, caplog, capsys):
    from sglang_tiered.integration import compat, plugin

    def boom():
        raise compat.SGLangCompatError("simulated incompatibility")

    monkeypatch.setattr(compat, "check_compat", boom)
    with pytest.raises(compat.SGLangCompatError):
        plugin.register()
    assert "simulated incompatibility" in caplog.text
    assert "plugin registration failed" in capsys.readouterr().err


def test_kernels_import_as_subpackage_not_bare_name():
    import sglang_tiered.kernels as ours

    assert ours.__name__ == "sglang_tiered.kernels"
    # The bare name `kernels` is another PyPI project; ours must never shadow it.
    spec = importlib.util.find_spec("kernels")
    assert spec is None or "sglang_tiered" not in (spec.origin or "")


def test_factory_rejects_unsupported_models():
    from types import SimpleNamespace

    from sglang_tiered.integration.plugin import tiered_cache_factory

    ctx = SimpleNamespace(
        disable_radix_cache=False, is_hybrid_swa=True, is_hybrid_ssm=False, is_dsa=False,
        enable_hierarchical_cache=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="full-attention"):
        tiered_cache_factory(ctx)
    ctx.is_hybrid_swa = False
    ctx.enable_hierarchical_cache = True
    with pytest.raises(ValueError, match="enable-hierarchical-cache"):
        tiered_cache_factory(ctx)
