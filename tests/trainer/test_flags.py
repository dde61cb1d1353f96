"""trainer/flags.py in one process on CPU: the Flags a step's exchange yields, the non-finite check on the device
values, and what `agree` hands the loop and the clock (the exchange across ranks is tests/trainer/test_parallel.py's
LateMax test)."""
import math

import pytest
import torch

from trainer.clock import Clock
from trainer.config import TrainConfig
from trainer.flags import FlagExchange, Flags


def clock(elapsed: float, budget_s: float = 100.0) -> Clock:
    c = Clock(TrainConfig(budget_s=budget_s))
    c.load_state_dict({"elapsed": elapsed, "synced": 0.0})
    return c


def test_a_step_exchange_yields_its_flags_once():
    exchange, one = FlagExchange(torch.device("cpu")), torch.tensor(1.0)
    assert exchange.collect() is None
    exchange.start(clock(120.0), stop=False, eval_due=True, save_due=False, loss=one, norm=one)
    assert exchange.collect() == Flags(120.0, True, False, True, False, False)
    assert exchange.collect() is None  # read once: the next step starts a new one


@pytest.mark.parametrize("loss, norm", [(math.nan, 1.0), (1.0, math.inf), (-math.inf, math.nan)])
def test_a_loss_or_norm_that_is_not_finite_raises_nonfinite(loss, norm):
    exchange = FlagExchange(torch.device("cpu"))
    exchange.start(clock(1.0), False, False, False, torch.tensor(loss), torch.tensor(norm))
    flags = exchange.collect()
    assert flags.nonfinite and flags.act() and not (flags.time_up or flags.sigterm)


def test_a_step_without_a_gradient_norm_is_judged_by_its_loss():
    exchange = FlagExchange(torch.device("cpu"))
    for loss, nonfinite in ((1.0, False), (math.nan, True)):
        exchange.start(clock(1.0), False, False, False, torch.tensor(loss), None)
        assert exchange.collect().nonfinite is nonfinite


def test_on_cpu_every_step_acts_on_its_own_flags_and_the_clock_adopts_their_time():
    exchange, one, c = FlagExchange(torch.device("cpu")), torch.tensor(1.0), clock(7.5)
    exchange.start(c, False, False, False, one, one)
    flags = exchange.agree(c, None, step_eval=False)
    assert flags == Flags(7.5, False, False, False, False, False) and not flags.act()
    assert c.synced == 7.5 and exchange.collect() is None
    exchange.start(c, True, False, False, one, one)  # a stop signal
    assert exchange.agree(c, None, step_eval=False).sigterm


def test_on_a_gpu_a_quiet_step_reads_nothing_and_a_step_that_acts_merges_the_step_befores_flags():
    # the protocol alone: the CPU exchange stands in for the GPU's (only `cuda` decides what agree reads)
    exchange, one, c = FlagExchange(torch.device("cpu")), torch.tensor(1.0), clock(3.0)
    exchange.cuda = True
    quiet = Flags(2.0, False, False, False, False, False)
    exchange.start(c, False, False, False, one, one)
    assert exchange.agree(c, quiet, step_eval=False) is None and c.synced == 2.0  # the step before's time
    assert exchange.collect() is not None  # still pending: the next step reads it
    exchange.start(c, False, False, True, one, one)  # this step wants a save
    wants_eval = quiet._replace(eval_due=True)
    assert exchange.agree(c, wants_eval, step_eval=False) == Flags(3.0, False, False, True, True, False)
    assert c.synced == 3.0 and exchange.collect() is None
    exchange.start(c, False, False, False, one, one)
    assert exchange.agree(c, quiet, step_eval=True) == Flags(3.0, False, False, False, False, False)
