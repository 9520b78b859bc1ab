"""The built wheel ships kernels/ as sglang_tiered.kernels (never as a top-level `kernels`)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_layout_and_entry_point(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "logs", "build", ".cache",
                                                             "*.egg-info", "bench"))  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
         "-w", str(tmp_path / "dist")],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("sglang_tiered-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sglang_tiered/kernels/__init__.py" in names
    # every package of the source tree is in the wheel (tier/ was once left out of a hand-kept list)
    for init in (ROOT / "sglang_tiered").rglob("__init__.py"):
        assert str(init.relative_to(ROOT)) in names, init
    assert not any(n.startswith("kernels/") for n in names)
    eps = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "[sglang.srt.plugins]" in eps and "tiered = sglang_tiered.integration.plugin:register" in eps
