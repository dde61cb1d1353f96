"""The README's config reference and commands stay in step with the code."""
import dataclasses
import re

import pytest

from tests.helpers import ROOT
from trainer.config import SECTIONS

README = (ROOT / "README.md").read_text()


def documented_keys(section: str) -> list[str]:
    """The keys of the README table under **[section]**."""
    match = re.search(rf"^\*\*\[{section}\]\*\*\n\n((?:\|.*\n)+)", README, re.M)
    assert match, f"README.md has no **[{section}]** table in its Configuration section"
    return re.findall(r"^\| `(\w+)` \|", match.group(1), re.M)


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_config_key_is_documented_once(section):
    code = [f.name for f in dataclasses.fields(SECTIONS[section])]
    assert documented_keys(section) == code, f"README [{section}] table differs from {SECTIONS[section].__name__}"


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    assert "bash run.sh          #" in README and "bash run.sh test     #" in README
    assert "bash run.sh test" in (ROOT / ".ci" / "run").read_text()
