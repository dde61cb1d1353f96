"""The README's config reference and commands stay in step with the code."""
import dataclasses
import fnmatch
import re
import typing

import pytest

from tests.helpers import ROOT
from model.config import choices
from trainer.config import SECTIONS

README = (ROOT / "README.md").read_text()
DESIGN = (ROOT / "docs" / "DESIGN.md").read_text()
# not the repository's code: other checkouts' outputs and caches, and the tests, which DESIGN.md names as a folder
NOT_CODE = {".venv", ".git", "__pycache__", ".pytest_cache", "runs", "shards", ".cache", "wandb", "tests"}


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


def layout_paths() -> list[str]:
    """The paths named in the first column of docs/DESIGN.md's layout table."""
    table = DESIGN.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return [path for cell in re.findall(r"^\| (.+?) \|", table, re.M) for path in re.findall(r"`([^`]+)`", cell)]


def test_design_layout_table_names_every_file_of_the_code_and_only_those():
    assert "](docs/DESIGN.md#layout)" in README
    named = layout_paths()
    assert [path for path in named if not list(ROOT.glob(path.rstrip("/")))] == [], "named but not in the repo"
    code = [p.relative_to(ROOT).as_posix() for suffix in ("py", "sh") for p in ROOT.rglob(f"*.{suffix}")
            if not NOT_CODE & set(p.relative_to(ROOT).parts)]
    unlisted = [path for path in code if not any(fnmatch.fnmatch(path, name) or path.startswith(name)
                                                  for name in named if name.endswith(("/", ".py", ".sh")))
                and not (path.endswith("/__init__.py") and "def " not in (ROOT / path).read_text())]
    assert unlisted == [], "code files docs/DESIGN.md's layout table does not name"


def test_design_stands_alone():
    # links resolve inside the repository; the paths it names are the repository's own (none climbs out of it),
    # and it cites no issue numbers
    links = [link for link in re.findall(r"\]\(([^)#]+)", DESIGN)
             if not ((ROOT / "docs" / link).exists() and (ROOT / "docs" / link).resolve().is_relative_to(ROOT))]
    assert links == [] and re.findall(r"`\.\./", DESIGN) == [] and re.findall(r"(?<![\w/&])#\d+", DESIGN) == []
