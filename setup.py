"""Package discovery (the rest of the metadata is in pyproject.toml): every package under
sglang_tiered/ is found automatically, so a new subpackage can never be left out of the wheel;
kernels/ ships as sglang_tiered.kernels.

One optional C extension, ``sglang_tiered.core._pagehash`` (chained page hashes in one call:
issue #11, session 41). ``optional=True``: where it cannot be built (no compiler, no Python
headers) the install still succeeds and ``core/keys.py`` uses its pure-Python reference."""

from setuptools import Extension, find_packages, setup

setup(
    packages=find_packages(include=["sglang_tiered", "sglang_tiered.*"]) + ["sglang_tiered.kernels"],
    package_dir={"sglang_tiered.kernels": "kernels"},
    ext_modules=[Extension("sglang_tiered.core._pagehash", ["sglang_tiered/core/_pagehash.c"], optional=True)],
)
