"""Optimizers: the [optim] config (config.py), Muon (muon.py: its views, views.py; NorMuon, normuon.py; the compiled
math, compiled.py; the symmetric products' kernel, symmetric.py), the record's bf16 storage (bf16_storage.py) and
the parameter groups of each recipe (groups.py).

Importing the package costs no torch, so trainer/config.py can read optim.config first.
"""
