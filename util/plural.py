"""Counts in messages: "1 file" and "3 files", never "1 files"."""
from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """`n` (with thousands separators) and `noun`, in its plural (`nouns`, else noun + "s") unless n is 1."""
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"
