"""Patch: guard torchvision's fake-kernel registrations for ``nms``/``qnms`` (torchvision 0.28.0).

Why: SGLang 0.5.23 imports torchvision at module level even for text models
(sglang/srt/configs/deepseek_ocr.py:7, sglang/srt/multimodal/internvl_utils.py:5). PyPI's
torchvision 0.28.0 wheel ships a ``_C.so`` linked against libtorch_cuda, which cannot load next to the
CPU torch build, so the ``torchvision::nms`` operator is never defined. Then
torchvision/_meta_registrations.py:163 and :177 (``@torch.library.register_fake("torchvision::nms")``
and ``"torchvision::qnms"``) raise "operator torchvision::nms does not exist" and the import fails.

The patch turns those two decorators into no-ops when the operator does not exist. Nothing in SGLang's
text-model path calls nms. Idempotent; ``--check`` exits 1 if the file is neither patched nor
patchable (the upstream lines moved), which tests/test_patches.py asserts.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

TARGET_VERSION = "0.28.0"
MARKER = "# sglang-tiered: torchvision_meta_guard"
OPS = ("torchvision::nms", "torchvision::qnms")
HELPER = f'''
{MARKER}
def _sglang_tiered_guarded_register_fake(op_name):
    try:
        torch._C._dispatch_find_schema_or_throw(op_name, "")
    except RuntimeError:
        return lambda fn: fn
    return torch.library.register_fake(op_name)
'''


def target_file() -> pathlib.Path:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("torchvision is not installed")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "_meta_registrations.py"


def patched_text(text: str) -> str:
    """Return the patched source, or raise ValueError if the upstream lines are not found."""
    if MARKER in text:
        return text
    for op in OPS:
        old = f'@torch.library.register_fake("{op}")'
        if text.count(old) != 1:
            raise ValueError(f"expected exactly one {old!r} in torchvision/_meta_registrations.py")
        text = text.replace(old, f'@_sglang_tiered_guarded_register_fake("{op}")')
    anchor = "import torch\n"
    if anchor not in text:
        raise ValueError("expected 'import torch' in torchvision/_meta_registrations.py")
    head, tail = text.split(anchor, 1)
    # Put the helper after the import block, before the first decorator that uses it.
    first_use = tail.index("@_sglang_tiered_guarded_register_fake")
    insert_at = tail.rfind("\n\n", 0, first_use)
    return head + anchor + tail[:insert_at] + "\n" + HELPER + tail[insert_at:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report whether the patch applies")
    args = ap.parse_args()
    path = target_file()
    text = path.read_text()
    try:
        new = patched_text(text)
    except ValueError as exc:
        print(f"torchvision_meta_guard: cannot apply to {path}: {exc}", file=sys.stderr)
        return 1
    if args.check:
        print("already applied" if new == text else "applies cleanly")
        return 0
    if new != text:
        path.write_text(new)
        print(f"torchvision_meta_guard: patched {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
