"""Helpers that data/ and trainer/ both stand on: atomic file writes, optional imports, counts in messages."""
