"""plural: counts in the words a person would write."""
from util.plural import plural


def test_plural():
    assert [plural(n, "token") for n in (0, 1, 2)] == ["0 tokens", "1 token", "2 tokens"]
    assert plural(1, "process", "processes") == "1 process" and plural(8, "process", "processes") == "8 processes"
