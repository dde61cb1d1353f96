"""The README, docs/CONFIG.md's key reference and docs/DESIGN.md's layout stay in step with the code."""
import base64
import dataclasses
import fnmatch
import json
import re
import shutil
import sys
import typing
from pathlib import Path

import pytest

from tests.helpers import ROOT, run
from model.config import choices
from trainer.config import SECTIONS

README = (ROOT / "README.md").read_text()
CONFIG = (ROOT / "docs" / "CONFIG.md").read_text()
DESIGN = (ROOT / "docs" / "DESIGN.md").read_text()
# not the repository's code: other checkouts' outputs and caches, and the tests, which DESIGN.md names as a folder
NOT_CODE = {".venv", ".git", "__pycache__", ".pytest_cache", "runs", "shards", ".cache", "wandb", "tests"}


def documented(section: str) -> list[tuple[str, str]]:
    """(key, its meaning) for each row of docs/CONFIG.md's table under **[section]**, in the table's order."""
    match = re.search(rf"^\*\*\[{section}\]\*\*\n\n((?:\|.*\n)+)", CONFIG, re.M)
    assert match, f"docs/CONFIG.md has no **[{section}]** table"
    return re.findall(r"^\| `(\w+)` \| .*? \| (.*) \|$", match.group(1), re.M)


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_config_key_is_documented_once(section):
    code = [f.name for f in dataclasses.fields(SECTIONS[section])]
    keys = [key for key, _ in documented(section)]
    assert keys == code, f"docs/CONFIG.md [{section}] table differs from {SECTIONS[section].__name__}"


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_allowed_value_is_documented(section):
    meanings = dict(documented(section))
    missing = [f"{section}.{key}: {value!r}" for key, hint in typing.get_type_hints(SECTIONS[section]).items()
               for value in choices(hint) if f'"{value}"' not in meanings[key]]
    assert not missing, f"docs/CONFIG.md's meaning of these keys does not name the value: {missing}"


def anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("name", ["README.md", "docs/CONFIG.md", "docs/PERFORMANCE.md"])
def test_links_resolve_to_files_and_headings(name):
    # the README points into docs/ and docs/ back into the README: a moved section must not leave a dead link
    path = ROOT / name
    broken = []
    for target, fragment in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", path.read_text()):
        if "://" in target:
            continue
        linked = (path.parent / target).resolve() if target else path
        if not linked.exists() or not linked.is_relative_to(ROOT):
            broken.append(target)
        elif fragment and fragment not in {anchor(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(), re.M)}:
            broken.append(f"{target}#{fragment}")
    assert broken == [], f"{name} links to what is not there"


def test_readme_links_the_key_reference_and_the_performance_tables():
    assert "](docs/CONFIG.md)" in README and "](docs/PERFORMANCE.md)" in README
    assert not re.search(r"^\*\*\[\w+\]\*\*$", README, re.M), "the key tables live in docs/CONFIG.md only"


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    assert "bash run.sh          #" in README and "bash run.sh test     #" in README
    assert "bash run.sh test" in (ROOT / ".ci" / "run").read_text()


def test_readme_is_a_users_guide_of_about_300_lines():
    # measurements and their history live in docs/PERFORMANCE.md, git and records/; the README says how to use it
    assert README.count("\n") <= 300, f"README.md has {README.count(chr(10))} lines"


@pytest.mark.parametrize("name", ["README.md", "docs/PERFORMANCE.md", "docs/DESIGN.md", "scripts/slurm/README.md"])
def test_the_commands_the_docs_name_exist(name):
    # commands get renamed: each `python -m` module and `bash` script a document tells people to run is still there
    text = (ROOT / name).read_text()
    modules = set(re.findall(r"python -m ((?:data|scripts|model|optim|trainer)(?:\.\w+)+)", text)) - {"scripts.x"}
    paths = {m: ROOT / m.replace(".", "/") for m in modules}
    missing = [m for m, p in paths.items() if not (p.with_suffix(".py").exists() or (p / "__main__.py").exists())]
    missing += [p for p in set(re.findall(r"bash ([\w/]+\.(?:sh|sbatch))", text)) if not (ROOT / p).exists()]
    assert missing == [], f"{name} names commands that are not in the repository"


def test_each_performance_table_names_the_command_that_reproduces_it():
    sections = re.split(r"^## ", (ROOT / "docs" / "PERFORMANCE.md").read_text(), flags=re.M)[1:]
    silent = [s.splitlines()[0] for s in sections if "\n|---" in s and not re.search(r"`(python -m|bash) ", s)]
    assert silent == [], "docs/PERFORMANCE.md sections with a table but no command"


def test_the_readmes_budgets_row_is_the_record_the_performance_table_reads():
    # the README rounds the budgets bench's medians; docs/PERFORMANCE.md's section names the JSON that holds them
    text = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    section = text.split("\n## The run planned for its budget\n", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"--json (\S+\.json)", section)
    assert command and f"[budgets.json](../{command.group(1)})" in section, "the section's command and link differ"
    record = json.loads((ROOT / command.group(1)).read_text())
    assert "\n| budget (x nanoGPT's time) |" in README, "README.md has no budgets table"
    header, _, losses = README.split("\n| budget (x nanoGPT's time) |", 1)[1].splitlines()[:3]
    assert [float(f) for f in re.findall(r"[\d.]+", header)] == [row["fraction"] for row in record["table"]]
    assert re.findall(r"[\d.]+", losses) == [f"{row['final_val_loss']:.3f}" for row in record["table"]]
    times = [rep["baseline"]["train_time_s"] for rep in record["raw"]]
    assert f"({record['baseline_final_val_loss']:.4f} in {min(times):.0f}–{max(times):.0f} s)" in README


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


def code_block_after(heading: str) -> list[str]:
    """The command lines (not comments) of the README's first ```bash block after `heading`."""
    block = README.split(heading, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def gpt2_sized_ranks(path: Path) -> Path:
    """A .tiktoken rank file of GPT-2's size (50,256 ranks + <|endoftext|> = 50,257 ids) for an offline test: the
    256 bytes, every pair of printable ASCII characters (so text merges), then tokens no text reaches."""
    printable = [bytes([c]) for c in range(32, 127)]
    tokens = [bytes([b]) for b in range(256)] + [a + b for a in printable for b in printable]
    tokens += [b"\x00\x01" + i.to_bytes(3, "big") for i in range(50256 - len(tokens))]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


@pytest.mark.slow
def test_the_own_corpus_quickstart_runs_as_written(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".venv", "runs", "shards", ".git", "__pycache__",
                                                             ".pytest_cache", ".cache", "records", "tests",
                                                             "wheels", "upstream"))
    # a small corpus of real prose: the README's paragraphs, one document each
    (repo / "corpus").mkdir()
    for i, paragraph in enumerate(p for p in README.split("\n\n")[:60] if len(p) > 200):
        (repo / "corpus" / f"{i:03d}.txt").write_text(paragraph)
    lines = code_block_after("**Your own corpus, start to finish**")
    assert len(lines) == 4 and "--tokenizer gpt2" in lines[0], lines
    # offline, GPT-2's BPE files cannot be fetched: a rank file of its size stands in for the name
    lines[0] = lines[0].replace("--tokenizer gpt2", f"--tokenizer {gpt2_sized_ranks(tmp_path / 'gpt2.tiktoken')}")
    # the sample's length is not what this test checks, and each token reruns the model on CPU
    lines[2] += " --tokens 8"
    env = {"SHARDRUN_VENV": sys.prefix, "BUDGET": "4", "PYTHONDONTWRITEBYTECODE": "1"}
    out = [run(["bash", "-c", line], cwd=repo, env=env, timeout=600) for line in lines]
    assert "fewer than the default val split" in out[0].stderr, out[0].stderr
    assert json.loads((repo / "shards" / "mine" / "meta.json").read_text())["vocab_size"] == 50257
    assert "train.py: note: the validation data holds" in out[1].stderr, out[1].stderr
    summary = json.loads((repo / "runs" / "mine" / "summary.json").read_text())
    assert summary["final_val_loss"] > 0 and summary["steps"] >= 1
    assert out[2].stdout.startswith("The ") and "cpu_gpt2" in out[3].stdout, out[3].stdout


def test_the_install_line_lets_a_script_elsewhere_import_the_project(tmp_path):
    # The README's line as written, in a throwaway venv that sees this venv's packages (as run.sh's venv holds
    # the requirements), then a script in a folder outside the repository imports the loader.
    line = "\n.venv/bin/python -m pip install --no-deps --no-build-isolation -e .\n"
    assert line in README
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "requirements.pth").write_text(next(p for p in sys.path if p.endswith("site-packages")) + "\n")
    # --python: this venv's pip installs into the throwaway one (made without pip, in a second)
    pip_args = line.split("-m pip ", 1)[1].split()
    run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "--disable-pip-version-check",
         *pip_args[:-1], str(ROOT)], cwd=tmp_path)
    script = tmp_path / "elsewhere" / "mine.py"
    script.parent.mkdir()
    script.write_text("import data.loader, trainer.config, train\nfrom data.loader import TokenLoader\n"
                      "print(data.loader.__file__)\n")
    out = run([str(venv / "bin" / "python"), str(script)], cwd=script.parent).stdout
    assert out.strip() == str(ROOT / "data" / "loader.py")
