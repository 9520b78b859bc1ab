"""The import rule (README, Architecture): core/ is pure Python (no torch, no sglang, no numpy),
and tier/ and kernels/ never import sglang (checked in a fresh interpreter, over every module);
layers import downward only and the package has no import circle (an AST walk of every import,
lazy ones included)."""

from __future__ import annotations

import ast
import pathlib
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


# ---------------------------------------------------------------- the import graph (AST, no import)
ROOT = pathlib.Path(__file__).resolve().parents[1]


def import_graph() -> dict[str, set[str]]:
    """module -> package modules it imports, at any level (lazy imports inside functions count:
    a circle through them is still a circle in the design). ``kernels/`` is ``sglang_tiered.kernels``."""
    mods = {}
    for p in sorted((ROOT / "sglang_tiered").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "kernels":
            parts.insert(0, "sglang_tiered")
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    graph = {}
    for m, p in mods.items():
        deps = set()
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                names = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
            else:
                continue
            deps.update(x for x in names if x in mods and x != m and not m.startswith(x + "."))
        graph[m] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative enough)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycles_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_import_circle_in_the_package():
    assert cycles(import_graph()) == []


def test_layers_import_downward_only():
    """core imports no other layer; tier and kernels import no integration (nor fleet, dev)."""
    for mod, deps in import_graph().items():
        if mod.startswith("sglang_tiered.core"):
            assert all(d.startswith("sglang_tiered.core") for d in deps), (mod, deps)
        if mod.startswith(("sglang_tiered.tier", "sglang_tiered.kernels")):
            bad = [d for d in deps if d.startswith(("sglang_tiered.integration", "sglang_tiered.fleet", "sglang_tiered.dev"))]
            assert not bad, (mod, bad)


# Development helpers (sglang_tiered/dev/) are never imported by the runtime. The two places that
# may reach them, lazily and never while serving: create_simulated (build.py, like SGLang's own
# RadixCache.create_simulated) and the command line's development commands (build-model, serve).
DEV_ENTRY_POINTS = {"sglang_tiered.integration.build", "sglang_tiered.cli"}


def test_runtime_never_imports_dev():
    for mod, deps in import_graph().items():
        if mod.startswith("sglang_tiered.dev") or mod in DEV_ENTRY_POINTS:
            continue
        bad = [d for d in deps if d.startswith("sglang_tiered.dev")]
        assert not bad, f"{mod} imports {bad}: development helpers belong to tests, benchmarks and tools only"


def test_serving_loads_no_dev_module():
    """What a server process imports (plugin registration, the adapter, hooks, HTTP, metrics)
    loads no module of sglang_tiered.dev."""
    code = ("import sys\n"
            "import sglang_tiered.integration.plugin as p, sglang_tiered.integration.tiered_radix_cache\n"
            "import sglang_tiered.integration.hooks, sglang_tiered.integration.http, sglang_tiered.integration.metrics\n"
            "print(sorted(m for m in sys.modules if m.startswith('sglang_tiered.dev')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
