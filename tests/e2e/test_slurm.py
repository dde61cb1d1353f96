"""SLURM batch files, run for real by bash with stand-in `srun`, `scontrol` and `torchrun` executables.

The stand-ins log their arguments; `srun` then runs its command here (as if on one node), so the staging
step really copies files and the launch line is exactly what the cluster would run.
"""
import os
import re
import subprocess

import pytest

from tests.helpers import ROOT

SLURM = ROOT / "scripts" / "slurm"
SBATCH_FILES = ["hackathon_4x8.sbatch", "multinode.sbatch"]
FAKES = {
    "srun": 'log srun "$@"\nwhile [[ $1 == -* ]]; do shift; done\nexec "$@"',
    "scontrol": '[[ "$*" == "show hostnames $SLURM_JOB_NODELIST" ]] || exit 9\n'
                'printf "gpu-07\\ngpu-08\\ngpu-09\\ngpu-10\\n"',
    "torchrun": 'log torchrun "$@"',
}


@pytest.fixture
def cluster(tmp_path):
    """Fake SLURM tools on PATH and the batch step's environment, submitted from this repository.

    Each fake logs one line per call: its name and arguments, tab-separated (newlines in an argument become spaces).
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    logger = f'log() {{ local IFS=$\'\\t\' a; a="$*"; echo "${{a//$\'\\n\'/ }}" >> "{log}"; }}'
    for name, body in FAKES.items():
        exe = bin_dir / name
        exe.write_text(f"#!/usr/bin/env bash\n{logger}\n{body}\n")
        exe.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "SLURM_SUBMIT_DIR": str(ROOT),
           "SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "gpu-[07-10]",
           "SLURM_CPUS_ON_NODE": "96", "SLURM_GPUS_ON_NODE": "8"}
    return {"env": env, "log": log, "tmp": tmp_path}


def sbatch(cluster, name, *args, check=True, **env):
    """Run a batch file the way the batch step would (bash, in some other directory); return the logged calls."""
    proc = subprocess.run(["bash", str(SLURM / name), *args], cwd=cluster["tmp"],
                          env={**cluster["env"], **env}, capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    calls = cluster["log"].read_text().splitlines() if cluster["log"].exists() else []
    return proc, [c.split("\t") for c in calls]


def split_launch(calls):
    """The one srun that launches torchrun: (srun options, torchrun arguments)."""
    launches = [c for c in calls if c[0] == "srun" and "torchrun" in c]
    assert len(launches) == 1 and calls[-1][0] == "torchrun", calls
    srun = launches[0]
    return srun[1:srun.index("torchrun")], calls[-1][1:]


@pytest.mark.parametrize("name", SBATCH_FILES)
def test_bash_syntax(name):
    subprocess.run(["bash", "-n", str(SLURM / name)], check=True)


def test_hackathon_allocation_headers():
    heads = re.findall(r"^#SBATCH (--[\w-]+)=(\S+)", (SLURM / "hackathon_4x8.sbatch").read_text(), re.M)
    assert dict(heads).items() >= {"--nodes": "4", "--ntasks-per-node": "1", "--gpus-per-node": "8",
                                   "--time": "00:12:00"}.items()


def test_hackathon_launch_line(cluster):
    _, calls = sbatch(cluster, "hackathon_4x8.sbatch", "--train.budget_s=60")
    srun, torchrun = split_launch(calls)
    assert {"--nodes=4", "--ntasks-per-node=1", "--cpus-per-task=96", "--kill-on-bad-exit=1"} <= set(srun)
    assert torchrun == ["--nnodes=4", "--nproc_per_node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu-07:29517",
                        "--rdzv-id=4242", "train.py", "--config", "configs/hackathon_32gpu.toml",
                        "--train.budget_s=60"]


def test_multinode_port_gpus_and_config_from_env(cluster):
    env = {"SLURM_NNODES": "2", "SLURM_GPUS_PER_NODE": "h100:4", "MASTER_PORT": "31111",
           "CONFIG": "configs/speedrun_8xh100.toml"}
    del cluster["env"]["SLURM_GPUS_ON_NODE"]
    _, calls = sbatch(cluster, "multinode.sbatch", **env)
    srun, torchrun = split_launch(calls)
    assert "--nodes=2" in srun
    assert torchrun[:5] == ["--nnodes=2", "--nproc_per_node=4", "--rdzv-backend=c10d",
                            "--rdzv-endpoint=gpu-07:31111", "--rdzv-id=4242"]
    assert torchrun[5:] == ["train.py", "--config", "configs/speedrun_8xh100.toml"]


def test_staging_copies_missing_files_once_and_trains_from_them(cluster):
    nfs, local = cluster["tmp"] / "nfs", cluster["tmp"] / "local"
    nfs.mkdir()
    local.mkdir()
    for i in range(1, 6):
        (nfs / f"chunk_{i:04d}.bin").write_bytes(bytes([i]) * (100 + i))
    (nfs / "notes.txt").write_text("not a shard")
    (local / "chunk_0002.bin").write_bytes(b"\0" * 102)  # same size as the source: taken as already staged
    (local / "chunk_0003.bin").write_bytes(b"\0" * 7)  # wrong size: copied again
    _, calls = sbatch(cluster, "hackathon_4x8.sbatch", "--optim.lr=0.01", STAGE_DATA="1", DATA_SRC=str(nfs),
                      LOCAL_DATA=str(local), STAGE_JOBS="2")
    assert sorted(p.name for p in local.iterdir()) == [f"chunk_{i:04d}.bin" for i in range(1, 6)]
    for i in (1, 3, 4, 5):
        assert (local / f"chunk_{i:04d}.bin").read_bytes() == bytes([i]) * (100 + i)
    assert (local / "chunk_0002.bin").read_bytes() == b"\0" * 102
    stage = calls[0]
    assert stage[0] == "srun" and {"--nodes=4", "--ntasks-per-node=1"} <= set(stage) and "torchrun" not in stage
    _, torchrun = split_launch(calls)
    assert torchrun[-2:] == [f"--data.train={local}/chunk_*.bin", "--optim.lr=0.01"]


def test_stage_only_copies_and_stops(cluster):
    nfs, local = cluster["tmp"] / "nfs", cluster["tmp"] / "local"
    nfs.mkdir()
    (nfs / "fineweb_train_000001.bin").write_bytes(b"abc")
    (nfs / "fineweb_val_000000.bin").write_bytes(b"val")  # the default glob leaves it: it would be trained on
    _, calls = sbatch(cluster, "multinode.sbatch", STAGE_ONLY="1", CONFIG="configs/speedrun_8xh100.toml",
                      DATA_SRC=str(nfs), LOCAL_DATA=str(local))
    assert [p.name for p in local.iterdir()] == ["fineweb_train_000001.bin"]
    assert [c[0] for c in calls] == ["srun"]


def test_staging_refuses_a_glob_that_takes_the_validation_shard(cluster):
    nfs = cluster["tmp"] / "nfs"
    nfs.mkdir()
    for name in ("fineweb_val_000000.bin", "fineweb_train_000001.bin"):
        (nfs / name).write_bytes(b"abc")
    proc, calls = sbatch(cluster, "multinode.sbatch", check=False, STAGE_DATA="1", STAGE_GLOB="*.bin",
                         CONFIG="configs/speedrun_8xh100.toml", DATA_SRC=str(nfs))
    assert proc.returncode == 2 and "matches the validation shard" in proc.stderr and calls == []


@pytest.mark.parametrize("env, message", [
    ({"CONFIG": "configs/nope.toml"}, "config configs/nope.toml not found"),
    ({"GPUS_PER_NODE": "eight"}, "cannot tell the GPUs per node"),
    ({"STAGE_DATA": "1", "DATA_SRC": "/nonexistent"},
     "nothing matches DATA_SRC/STAGE_GLOB = '/nonexistent/chunk_*.bin'"),
])
def test_bad_setup_fails_before_launch(cluster, env, message):
    proc, calls = sbatch(cluster, "hackathon_4x8.sbatch", check=False, **env)
    assert proc.returncode == 2 and message in proc.stderr
    assert calls == []


def test_multinode_needs_a_config(cluster):
    proc, calls = sbatch(cluster, "multinode.sbatch", check=False)
    assert proc.returncode != 0 and "set CONFIG=configs/<name>.toml" in proc.stderr
    assert calls == []
