"""Helpers with no home of their own: atomic file writes, optional imports, counts in messages, the exceptions
behind an exception, a command in a process group of its own."""
