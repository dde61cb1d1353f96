"""Every module of the packages has its test file, so a reader finds a module's tests on the first try.

The rule, from a module's path to its test file's:
- `<pkg>/<mod>.py` -> `tests/<pkg>/test_<mod>.py`;
- `<pkg>/<sub>/<mod>.py` -> `tests/<pkg>/test_<sub>_<mod>.py`, except for a subpackage that is one program (it has a
  `__main__.py`: scripts/gpu_check): `tests/<pkg>/test_<sub>.py` holds the tests of all its modules;
- `<pkg>/__init__.py` -> `tests/<pkg>/test_init.py`, when it defines a function or class (a package marker or a
  constant needs no test); `__main__.py` only starts the package, so it has none.
A test file may hold more than its module's tests' home (`test_compile.py`, `test_ddp_always.py`): the rule asks
for the module's file, not that every file be a module's.
"""
import ast

import pytest

from tests.helpers import PACKAGES, ROOT


def _defines_something(path) -> bool:
    return any(isinstance(node, (ast.FunctionDef, ast.ClassDef)) for node in ast.parse(path.read_text()).body)


def expected_test(module) -> str:
    """The test file (relative to the root) that the rule above names for `module` (a path under ROOT)."""
    parts = module.relative_to(ROOT).with_suffix("").parts
    pkg, inner = parts[0], list(parts[1:])
    if len(inner) > 1 and (ROOT / pkg / inner[0] / "__main__.py").exists():
        inner = inner[:1]
    name = "_".join("init" if part == "__init__" else part for part in inner) or "init"
    return f"tests/{pkg}/test_{name}.py"


def modules() -> list:
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name == "__main__.py" or (path.name == "__init__.py" and not _defines_something(path)):
                continue
            found.append(path)
    return found


def test_the_rule_names_the_files_it_says():
    assert expected_test(ROOT / "trainer" / "checkpoint.py") == "tests/trainer/test_checkpoint.py"
    assert expected_test(ROOT / "scripts" / "bench" / "memory.py") == "tests/scripts/test_bench_memory.py"
    assert expected_test(ROOT / "scripts" / "gpu_check" / "probe.py") == "tests/scripts/test_gpu_check.py"
    assert expected_test(ROOT / "model" / "__init__.py") == "tests/model/test_init.py"


@pytest.mark.parametrize("module", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_has_its_test_file(module):
    want = expected_test(module)
    assert (ROOT / want).is_file(), f"{module.relative_to(ROOT)} has no tests: write them in {want}"
