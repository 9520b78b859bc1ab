"""The tree state machine (tests/test_tree_state_machine.py) at page size 1, SGLang's default
(session 18: every other state machine runs at page 2-16): the same rules and invariants, with
every token a page, so no partial tail page and one-token nodes."""

from __future__ import annotations

import pathlib
import types

_src = pathlib.Path(__file__).with_name("test_tree_state_machine.py").read_text()
assert "\nPAGE = 4\n" in _src, "test_tree_state_machine.py no longer sets PAGE = 4: update this file"
_mod = types.ModuleType("tree_state_machine_page1")
_mod.__file__ = __file__
exec(compile(_src.replace("\nPAGE = 4\n", "\nPAGE = 1\n", 1), __file__, "exec"), _mod.__dict__)

TestTreePage1 = _mod.TestTree
