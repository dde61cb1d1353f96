"""Process groups and collectives: a single process has no group and every collective is the identity; a group of
one (gloo) runs them for real; on 2 gloo ranks (one torchrun launch) they reduce, broadcast, report an error once
and hand the flag exchange's result to every rank one call late."""
import pytest
import torch

from tests.helpers import ROOT, tiny_args, tiny_data, torchrun
from trainer import distributed
from trainer.distributed import Dist, LateMax

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def alone(monkeypatch) -> None:
    """A process that torchrun did not start, whose reporting store is this test's own."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(distributed, "_store", None)


@pytest.fixture
def group_of_one(alone) -> Dist:
    """train.ddp_always's group: this process alone, on gloo over an in-process store."""
    dist = distributed.init(60.0, group_of_one=True)
    yield dist
    distributed.close()


def test_a_process_that_torchrun_did_not_start_joins_no_group_and_its_collectives_are_the_identity(alone):
    dist = distributed.init(60.0)
    assert not torch.distributed.is_initialized()
    assert (dist.rank, dist.local_rank, dist.world_size, dist.master) == (0, 0, 1, True)
    assert dist.cuda == torch.cuda.is_available() and dist.device.type == ("cuda" if dist.cuda else "cpu")
    values = torch.tensor([1.0, -2.0])
    assert distributed.all_reduce(values) is values and values.tolist() == [1.0, -2.0]
    assert distributed.max_over_ranks([1.5, -2.0], dist.device) == [1.5, -2.0]
    assert distributed.any_rank([True, False], dist.device) == [True, False]
    state = {"step": 3}
    assert distributed.broadcast(state) is state
    distributed.barrier()
    distributed.close()  # with no group, nothing to leave


def test_rank_0_is_the_master_and_a_gpu_rank_is_cuda():
    assert Dist().master and not Dist().cuda
    assert not Dist(rank=1, world_size=2).master
    assert Dist(device=torch.device("cuda", 0)).cuda  # a device named, not used: no GPU needed


def test_before_the_group_only_rank_0_reports(alone, monkeypatch):
    assert distributed.first_to_report("loss is nan")
    monkeypatch.setenv("RANK", "1")
    assert not distributed.first_to_report("loss is nan")


def test_a_group_of_one_runs_the_collectives_on_gloo_and_reports_each_kind_once(group_of_one):
    assert torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
    assert torch.distributed.get_world_size() == 1 and group_of_one.world_size == 1
    assert distributed.all_reduce(torch.tensor([2.0, 3.0])).tolist() == [2.0, 3.0]
    assert distributed.any_rank([False, True], group_of_one.device) == [False, True]
    assert distributed.broadcast({"step": 3}) == {"step": 3}
    distributed.barrier()
    assert distributed.first_to_report("loss is nan") and not distributed.first_to_report("loss is nan")
    assert distributed.first_to_report("out of memory")
    distributed.close()
    assert not torch.distributed.is_initialized()
    # the store outlives the group: an error reported while it closed is not said again
    assert not distributed.first_to_report("out of memory")


def test_the_flag_exchange_in_one_process_returns_what_it_was_given_once():
    flags = LateMax(2, 1, torch.device("cpu"))
    assert flags.collect() is None
    flags.start([4.0, 0.0], torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(AssertionError, match="collect"):
        flags.start([5.0, 0.0], torch.tensor([0.0], dtype=torch.float64))  # its buffers hold the pending one
    assert flags.collect() == [4.0, 0.0, 1.0] and flags.collect() is None


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("collectives") / "results.pt"
    torchrun([ROOT / "tests" / "workers" / "collective_worker.py", out], env={"PYTHONPATH": str(ROOT)})
    return torch.load(out, weights_only=True)


def test_two_ranks_reduce_and_broadcast(two_ranks):
    for rank in two_ranks:
        assert rank["sum"] == [3.0, 4.0] and rank["max"] == [1.0, 0.0]
        assert rank["max_over_ranks"] == [1.0, 5.0, 0.5] and rank["any_rank"] == [True, True, False]
        assert rank["broadcast"] == {"from": 0}


def test_an_error_every_rank_hits_is_reported_by_one_rank_and_an_error_of_one_rank_by_it(two_ranks):
    # per rank: before the group, the shared error, its own error, the shared error again
    before, shared, own, again = zip(*(rank["report"] for rank in two_ranks))
    assert before == (True, False) and sorted(shared) == [False, True]
    assert own == (True, True) and again == (False, False)


def test_the_flag_exchange_is_read_one_call_late_and_the_same_on_every_rank(two_ranks):
    # per call: max over ranks of (10 * rank + call, rank 1's host flag at call 2), then rank 0's device flag
    # at call 1; each collect() returns the previous start()'s result, and None when nothing is pending
    want = [None, [10.0, 0.0, 0.0], [11.0, 0.0, 1.0], [12.0, 1.0, 0.0], [13.0, 0.0, 0.0], None]
    assert [rank["late"] for rank in two_ranks] == [want, want]


def test_a_rank_still_compiling_its_warm_up_does_not_time_out_the_ranks_waiting_for_it(tmp_path):
    """The warm-up compiles (minutes on 8 GPUs, cold): its collectives wait train.warmup_timeout_s, the rest
    train.dist_timeout_s. Rank 1 here starts its warm-up 6 s late: with a 30-s warm-up timeout the run ends as
    usual; with a 3-s one rank 0 gives up in the warm-up's first all-reduce, though the group's own timeout is
    120 s (long enough that two ranks starting at different speeds on a busy machine never meet it)."""
    data = tiny_data(tmp_path / "data")

    def launched(run_id: str, warmup_timeout_s: float):
        args = tiny_args(data, tmp_path / "runs", run_id, "--train.timing=exclude_warmup", "--train.warmup_steps=1",
                         "--train.max_steps=3", "--train.dist_timeout_s=120",
                         f"--train.warmup_timeout_s={warmup_timeout_s}")
        return torchrun([ROOT / "tests" / "workers" / "slow_rank_worker.py", "6", *args[1:]],
                        env={"PYTHONPATH": str(ROOT)}, check=False, timeout=300)

    patient = launched("patient", 30)
    assert patient.returncode == 0 and "done: completed | step 3 |" in patient.stdout, patient.stderr[-3000:]
    impatient = launched("impatient", 3)
    assert impatient.returncode != 0 and "done:" not in impatient.stdout
