"""The README's config reference and commands stay in step with the code."""
import dataclasses
import re
import typing

import pytest

from tests.helpers import ROOT
from model.config import choices
from trainer.config import SECTIONS

README = (ROOT / "README.md").read_text()


def documented(section: str) -> dict[str, str]:
    """{key: its meaning} of the README table under **[section]**, in the table's order."""
    match = re.search(rf"^\*\*\[{section}\]\*\*\n\n((?:\|.*\n)+)", README, re.M)
    assert match, f"README.md has no **[{section}]** table in its Configuration section"
    return dict(re.findall(r"^\| `(\w+)` \| .*? \| (.*) \|$", match.group(1), re.M))


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_config_key_is_documented_once(section):
    code = [f.name for f in dataclasses.fields(SECTIONS[section])]
    assert list(documented(section)) == code, f"README [{section}] table differs from {SECTIONS[section].__name__}"


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_allowed_value_is_documented(section):
    meanings = documented(section)
    missing = [f"{section}.{key}: {value!r}" for key, hint in typing.get_type_hints(SECTIONS[section]).items()
               for value in choices(hint) if f'"{value}"' not in meanings[key]]
    assert not missing, f"README's meaning of these keys does not name the value: {missing}"


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    assert "bash run.sh          #" in README and "bash run.sh test     #" in README
    assert "bash run.sh test" in (ROOT / ".ci" / "run").read_text()
