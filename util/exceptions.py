"""The exceptions behind an exception: what it was raised from or while handling. torch.save's zip writer, cut
mid-write (a full disk, a signal), raises "unexpected pos ..." on its way out, hiding the exception that cut it."""
from __future__ import annotations

from typing import Iterator


def chain(error: BaseException | None) -> Iterator[BaseException]:
    """`error`, then the exception it was raised from or while handling, and so on back."""
    seen = set()  # a chain set by hand may loop
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__
