"""Benchmarks that print their ratios against their targets: the loader (loader.py), page-cache sharing and
memory (memory.py), the CPU recipe against nanoGPT's (recipe.py), the runs planned for their budgets (budgets.py),
the optimizer step's keys (optimizer.py), and the speedrun beside the record (beside_record.py)."""
