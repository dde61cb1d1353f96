"""Errors at start: a config error comes before torch is imported, and an error that every rank hits prints
once, not once per rank (8 copies under 8 processes, 32 at the hackathon), before the process group exists
and after; real torchrun runs on gloo."""
import sys

from tests.helpers import TRAIN, run, tiny_args, tiny_data, torchrun


def test_a_config_error_comes_before_torch_is_imported():
    probe = ("import runpy, sys\n"
             f"sys.argv = [{TRAIN!r}, '--config', 'configs/tiny.toml', '--train.batch_sise=4']\n"
             "try:\n"
             f"    runpy.run_path({TRAIN!r}, run_name='__main__')\n"
             "finally:\n"
             "    print('torch imported:', 'torch' in sys.modules)\n")
    proc = run([sys.executable, "-c", probe], check=False)
    assert proc.returncode == 1 and proc.stdout == "torch imported: False\n", proc.stdout + proc.stderr
    assert proc.stderr.startswith("train.py: config error: command line: unknown key train.batch_sise")


def test_an_error_every_rank_hits_prints_once(tmp_path):
    data = tiny_data(tmp_path / "data")
    # from the command line, before the process group exists
    proc = torchrun(tiny_args(data, tmp_path / "runs", "once", "--train.batch_sise=4"), check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("train.py: config error: command line: unknown key train.batch_sise") == 1, proc.stderr
    # from the data, found by every rank after the group has formed
    proc = torchrun(tiny_args(data, tmp_path / "runs", "once", f"--data.train={data}/*_trian_*.bin"), check=False)
    assert proc.returncode != 0
    assert proc.stderr.count(f"config error: data.train = '{data}/*_trian_*.bin' matches no file") == 1, proc.stderr
