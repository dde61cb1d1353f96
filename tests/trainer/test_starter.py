"""The hackathon starter's flags: one line at start says which were applied and which the config overrode."""
from tests.helpers import TRAIN, make_shards, torchrun
from trainer.config import parse_args

SUBMIT = ["--data_dir", "/home/data/", "--checkpoint_path", "checkpoint.pt", "--seq_len", "1024", "--batch_size",
          "8", "--grad_accum_steps", "4", "--max_steps", "5000", "--time_limit_min", "10"]


def test_the_organizers_flags_on_the_hackathon_config_say_what_the_file_overrides():
    cfg = parse_args(SUBMIT)  # exactly as submit.sh passes them: they select configs/hackathon_32gpu.toml
    assert cfg.starter == (
        "hackathon starter flags: applied --data_dir /home/data/ (data.train = '/home/data/chunk_*.bin', "
        "data.format = 'raw', data.val = 'holdout'), --checkpoint_path checkpoint.pt (train.checkpoint_path = "
        "'checkpoint.pt'), --time_limit_min 10.0 (train.budget_s = 600.0, train.schedule = 'time'); overridden by "
        "configs/hackathon_32gpu.toml, whose tuned recipe wins over the starter's generic one: --seq_len 1024 "
        "(train.seq_len = 1024), --batch_size 8 (train.batch_size = 32), --grad_accum_steps 4 (train.grad_accum = "
        "1), --max_steps 5000 (train.max_steps = 0)")
    assert cfg.train.max_steps == 0  # 5,000 steps would end a fast 32-GPU run before its 600 s


def test_a_command_line_key_overrides_a_starter_flag_and_a_silent_file_takes_the_shape(tmp_path):
    silent = tmp_path / "silent.toml"
    silent.write_text("[eval]\ntokens = 4096\n")
    cfg = parse_args(["--config", str(silent), "--batch_size", "3", "--time_limit_min", "0.5", "--data.train=x",
                      "--train.budget_s=7"])
    assert cfg.starter == ("hackathon starter flags: applied --batch_size 3 (train.batch_size = 3); overridden by "
                           "a --section.key=value on the command line: --time_limit_min 0.5 (train.budget_s = 7.0, "
                           "train.schedule = 'time')")
    assert parse_args(["--config", str(silent), "--data.train=x", "--train.schedule=step",
                       "--train.max_steps=3"]).starter == ""


def test_train_prints_the_line_once_for_all_ranks(tmp_path):
    make_shards(tmp_path / "data", [20000, 20000], vocab=512, header=False, pattern="chunk_{:04d}.bin", start=1)
    proc = torchrun([TRAIN, "--config", "configs/tiny.toml", "--model.vocab_size=512",
                     f"--log.dir={tmp_path / 'runs'}", "--log.run_id=s", "--eval.tokens=2048",
                     "--data_dir", tmp_path / "data", "--seq_len", "32", "--max_steps", "2", "--time_limit_min", "1"])
    said = [line for line in proc.stdout.splitlines() if line.startswith("hackathon starter flags: ")]
    assert said == [f"hackathon starter flags: applied --data_dir {tmp_path / 'data'} (data.train = "
                    f"'{tmp_path / 'data' / 'chunk_*.bin'}', data.format = 'raw', data.val = 'holdout'), "
                    f"--time_limit_min 1.0 (train.budget_s = 60.0, train.schedule = 'time'); overridden by "
                    f"configs/tiny.toml, whose tuned recipe wins over the starter's generic one: --seq_len 32 "
                    f"(train.seq_len = 64), --max_steps 2 (train.max_steps = 30)"]
    assert said[0] in (tmp_path / "runs" / "s" / "log.txt").read_text()
