"""chain: an exception and the ones behind it, as torch.save's zip writer leaves them when a write is cut."""
import io

import torch

from util.exceptions import chain


class Cut(Exception):
    """What cut the write: a full disk's OSError, a Ctrl-C's SystemExit."""


class CutAtSecondWrite(io.BytesIO):
    writes = 0

    def write(self, data):
        self.writes += 1
        if self.writes == 2:
            raise Cut("cut")
        return super().write(data)


def test_the_exception_that_cut_torch_save_is_behind_the_one_it_raises():
    try:
        torch.save({"w": torch.zeros(4)}, CutAtSecondWrite())
    except Exception as e:  # noqa: BLE001 - whatever torch raises in its place
        raised = e
    assert [type(e) for e in chain(raised)] == [RuntimeError, Cut] and "unexpected pos" in str(raised)


def test_a_cause_comes_before_the_context_and_a_loop_ends():
    handled, cause = ValueError("handled"), KeyError("cause")
    try:
        try:
            raise handled
        except ValueError:
            raise TypeError("raised") from cause
    except TypeError as e:
        raised = e
    assert [type(e) for e in chain(raised)] == [TypeError, KeyError]  # from: the explicit cause wins
    handled.__context__ = raised  # a loop set by hand
    raised.__cause__ = None
    assert list(chain(raised)) == [raised, handled] and list(chain(None)) == []
