"""`bash run.sh bench NAME`: a name that is no benchmark lists the ones there are, before installing anything."""
from tests.helpers import ROOT, run


def test_an_unknown_benchmark_lists_the_benchmarks(tmp_path):
    names = " ".join(sorted(p.stem for p in (ROOT / "scripts" / "bench").glob("[a-z]*.py")))
    assert names == "beside_record budgets loader memory optimizer recipe"
    # a venv that does not exist: the answer must come before run.sh would create one
    venv = tmp_path / "venv"
    proc = run(["bash", "run.sh", "bench", "bogus"], env={"SHARDRUN_VENV": str(venv)}, check=False, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "" and not venv.exists()
    assert proc.stderr == f"run.sh bench: no benchmark 'bogus'; the benchmarks are: {names} (scripts/bench/NAME.py)\n"
