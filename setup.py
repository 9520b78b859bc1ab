"""Package discovery (the rest of the metadata is in pyproject.toml): every package under
sglang_tiered/ is found automatically, so a new subpackage can never be left out of the wheel;
kernels/ ships as sglang_tiered.kernels.

Two optional C extensions: ``sglang_tiered.core._pagehash`` (chained page hashes in one call:
issue #11, session 41) and ``sglang_tiered.core._bookkeeping`` (the admission duel's miniatures
and the TinyLFU sketch: issue #11, session 42; the tree shadows: session 43; the divergence:
session 45). ``optional=True``: where one cannot be built (no compiler, no Python headers) the
install still succeeds and ``core/keys.py``, ``core/miniature.py``, ``core/sketch.py`` and
``core/shadows.py`` use their pure-Python references."""

from setuptools import Extension, find_packages, setup

setup(
    packages=find_packages(include=["sglang_tiered", "sglang_tiered.*"]) + ["sglang_tiered.kernels"],
    package_dir={"sglang_tiered.kernels": "kernels"},
    ext_modules=[Extension("sglang_tiered.core._pagehash", ["sglang_tiered/core/_pagehash.c"], optional=True),
                 Extension("sglang_tiered.core._bookkeeping", ["sglang_tiered/core/_bookkeeping.c"], optional=True)],
)
