"""Benchmarks that print their ratios against their targets: the loader (loader.py), page-cache sharing and
memory (memory.py), and the CPU recipe against nanoGPT's (recipe.py)."""
