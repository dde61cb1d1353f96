"""Security: no unpickling or code evaluation of user data, config paths stay paths, secrets never leak."""
import ast
import re
import sys
from pathlib import Path

import pytest

import train
from tests.helpers import ROOT, run, tiny_args, tiny_data
from trainer.config import ConfigError, parse_args

SKIP_DIRS = {".venv", ".git", "__pycache__", ".pytest_cache", "runs", "shards", ".cache", "wandb"}
SENTINEL = "s3ntinel-7f3a9c1e-do-not-leak"
CONTROL = "c0ntrol-5b2e-in-the-config"
SECRETS = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "GITHUB_TOKEN", "OPENAI_API_KEY", "MY_SERVICE_KEY")


def python_files() -> list[Path]:
    """Every .py file of the repository, outside virtualenvs, caches and run outputs."""
    return sorted(p for p in ROOT.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(ROOT).parts))


def _keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value for k in call.keywords)


def _dotted(node: ast.AST) -> str:
    """`torch.load` for an attribute chain, `eval` for a bare name, '' otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and _dotted(node.value):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def unsafe_calls(source: str) -> list[str]:
    """Calls that can run code hidden in a file or a string: unpickling, eval/exec, shells."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        # torch.load without weights_only=True unpickles arbitrary objects (torch < 2.6 defaults to False)
        if name == "torch.load" and not _keyword_is(node, "weights_only", True):
            found.append(f"line {node.lineno}: torch.load without weights_only=True")
        elif name in ("eval", "exec", "pickle.load", "pickle.loads", "marshal.loads", "os.system", "os.popen",
                      "yaml.load", "yaml.unsafe_load"):
            found.append(f"line {node.lineno}: {name}(...)")
        elif name in ("np.load", "numpy.load") and _keyword_is(node, "allow_pickle", True):
            found.append(f"line {node.lineno}: {name}(allow_pickle=True)")
        elif _keyword_is(node, "shell", True):
            found.append(f"line {node.lineno}: {name}(shell=True)")
    return found


@pytest.mark.parametrize("snippet, problem", [
    ("torch.load(p)", "torch.load without weights_only=True"),
    ("torch.load(p, weights_only=False)", "torch.load without weights_only=True"),
    ("torch.load(p, map_location='cpu')", "torch.load without weights_only=True"),
    ("x = eval(text)", "eval(...)"),
    ("exec(open(path).read())", "exec(...)"),
    ("import pickle; pickle.load(f)", "pickle.load(...)"),
    ("np.load(p, allow_pickle=True)", "np.load(allow_pickle=True)"),
    ("subprocess.run(cmd, shell=True)", "subprocess.run(shell=True)"),
    ("os.system('rm ' + path)", "os.system(...)"),
])
def test_the_scanner_finds_each_unsafe_call(snippet, problem):
    assert [f"line 1: {problem}"] == unsafe_calls(snippet)


def test_the_scanner_accepts_the_safe_spellings():
    assert unsafe_calls("torch.load(p, weights_only=True, map_location='cpu')\nmodel.eval()\n"
                        "np.load(p)\nsubprocess.run(['git', 'status'])\nast.literal_eval(s)") == []


def test_no_file_in_the_repository_unpickles_or_evaluates_data():
    files = python_files()
    assert ROOT / "train.py" in files and ROOT / "trainer" / "checkpoint.py" in files and len(files) > 20
    problems = [f"{p.relative_to(ROOT)} {issue}" for p in files for issue in unsafe_calls(p.read_text())]
    assert problems == [], "\n".join(problems)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Tiny real train and val shards."""
    return tiny_data(tmp_path_factory.mktemp("shards"), train_sizes=(6000, 6000))


def test_config_paths_are_only_paths(shards, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a shell substitution in a path would create `pwned` if anything handed the value to a shell
    trap = tmp_path / "pwned"
    argv = ["--config", str(ROOT / "configs" / "tiny.toml"), f"--data.val={shards}/*_val_*.bin", "--log.dir=runs"]
    with pytest.raises(ConfigError, match=re.escape(f"data.train = '$(touch {trap})/*.bin' matches no file")):
        train.main(parse_args([*argv, f"--data.train=$(touch {trap})/*.bin", "--log.run_id=x"]))
    with pytest.raises(ConfigError, match=re.escape("log.run_id = '../escape' must be a plain folder name")):
        train.main(parse_args([*argv, f"--data.train={shards}/*_train_*.bin", "--log.run_id=../escape"]))
    assert list(tmp_path.iterdir()) == [], "nothing may be created: not the trap, not a run folder"


def test_secrets_in_the_environment_never_reach_output_or_files(shards, tmp_path):
    env = {name: f"{SENTINEL}-{name}" for name in SECRETS}
    # WANDB_API_KEY must look like a key (40 characters) or wandb refuses it before the run starts
    env["WANDB_API_KEY"] = (SENTINEL + "x" * 40)[:40]
    env["WANDB_MODE"] = "offline"  # wandb writes its files (run config, metadata, logs) into the run folder
    proc = run([sys.executable, *tiny_args(shards, tmp_path / "runs", "secret", "--train.max_steps=3",
                                           "--log.wandb=true", f"--log.wandb_run={CONTROL}",
                                           "--train.checkpoint_every_s=1e-9")], env=env, timeout=240)
    run_dir = tmp_path / "runs" / "secret"
    files = {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert any("wandb" in name for name in files), "wandb wrote nothing: the offline logging path did not run"
    # the control: a value that belongs in the config is found, in text files and in the pickled checkpoint
    assert {"config.toml", "checkpoint.pt"} <= {name for name, data in files.items() if CONTROL.encode() in data}
    leaks = [name for name, data in files.items() if SENTINEL[:20].encode() in data]
    leaks += [stream for stream in ("stdout", "stderr") if SENTINEL[:20] in getattr(proc, stream)]
    assert leaks == [], f"a secret from the environment was written to {leaks}"
