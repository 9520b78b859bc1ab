"""The import rule (README, Architecture): core/ is pure Python (no torch, no sglang, no numpy),
and tier/ and kernels/ never import sglang. Checked in a fresh interpreter, over every module."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import sglang_tiered.{pkg} as p
for m in pkgutil.iter_modules(p.__path__):
    importlib.import_module("sglang_tiered.{pkg}." + m.name)
print(sorted(k for k in {banned!r} if k in sys.modules))
"""


def _loaded(pkg: str, banned: tuple) -> list:
    out = subprocess.run([sys.executable, "-c", CHECK.format(pkg=pkg, banned=banned)], capture_output=True,
                         text=True, timeout=300, check=True)  # fmt: skip
    return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own printed list


def test_core_is_pure_python():
    assert _loaded("core", ("torch", "sglang", "numpy", "triton")) == []


def test_tier_and_kernels_do_not_import_sglang():
    assert _loaded("tier", ("sglang",)) == []
    assert _loaded("kernels", ("sglang",)) == []
