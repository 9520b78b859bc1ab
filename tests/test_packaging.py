"""The built wheel ships kernels/ as sglang_tiered.kernels (never as a top-level `kernels`)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

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


@pytest.mark.server
def test_wheel_installs_into_a_fresh_venv_and_serves_with_t1(tmp_path, tiny_model_path):
    """pip install of the built wheel (not the editable tree) gives a working backend with T1 on:
    a fresh virtual environment borrows this one's third-party packages (sglang, torch) through a
    path file, but not its editable sglang_tiered, and the server runs outside the source tree."""
    import sysconfig
    import venv

    from sglang_tiered.dev.server import Server, ServerSpec

    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "logs", "build", ".cache",
                                                             "*.egg-info", "bench", "tests"))  # fmt: skip
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("sglang_tiered-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    fresh_site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    ours = sysconfig.get_paths()["purelib"]
    # A plain path line: the packages become importable, the editable finder's .pth is not run.
    (pathlib.Path(fresh_site) / "borrowed.pth").write_text(ours + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", fresh_site, str(wheel)],
                   check=True, capture_output=True)  # fmt: skip
    # Nothing of the source tree on the path (a PYTHONPATH pointing at a checkout would shadow the
    # wheel; an empty one adds no entry), for the probe and for the server.
    clean = {**os.environ, "PYTHONPATH": ""}
    probe = subprocess.run([str(py), "-c", "import sglang_tiered.tier.host_pool as m, sglang_tiered.kernels as k; "
                            "print(m.__file__); print(k.__file__)"], cwd=tmp_path, env=clean,
                           capture_output=True, text=True)  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    where = probe.stdout
    assert str(ROOT) not in where and fresh_site in where, where
    spec = ServerSpec(model_path=tiny_model_path, max_total_tokens=2048, python=str(py), cwd=str(tmp_path),
                      env={"SGLANG_TIERED_HOST": "on", "PYTHONPATH": ""})  # fmt: skip
    with Server(spec, tmp_path / "wheel-server.log") as server:
        out = server.generate({"text": "hello world " * 40, "sampling_params": {"max_new_tokens": 2}})
        host = next(t for t in server.request("GET", "/cache/stats")[1]["tiers"] if t["name"] == "host")
    assert out["meta_info"]["prompt_tokens"] > 0 and host["enabled"], host
    assert "impl=TieredRadixCache" in (tmp_path / "wheel-server.log").read_text()
