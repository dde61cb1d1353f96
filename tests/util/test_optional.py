"""import_optional: a package only a feature needs is imported when that feature runs, and a missing one is named
with the command that installs it."""
import sys

import pytest

from util.optional import import_optional


def test_a_present_package_is_imported():
    assert import_optional("json", "logging") is sys.modules["json"]


def test_a_missing_package_is_named_with_the_fix_in_the_error_asked_for():
    with pytest.raises(RuntimeError, match=r"^plotting needs the Python package no_such_pkg, which .* lacks: pip install "
                                           r"no_such_pkg \(requirements.txt pins it; .*bash run.sh wheels"):
        import_optional("no_such_pkg.sub", "plotting", RuntimeError)


def test_a_broken_package_keeps_its_own_error():
    # the package is there, a module inside it is not: not "install it", but the real ModuleNotFoundError
    with pytest.raises(ModuleNotFoundError, match="json.no_such_module"):
        import_optional("json.no_such_module", "logging")
