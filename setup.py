"""Package discovery (the rest of the metadata is in pyproject.toml): every package under
sglang_tiered/ is found automatically, so a new subpackage can never be left out of the wheel;
kernels/ ships as sglang_tiered.kernels."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["sglang_tiered", "sglang_tiered.*"]) + ["sglang_tiered.kernels"],
    package_dir={"sglang_tiered.kernels": "kernels"},
)
