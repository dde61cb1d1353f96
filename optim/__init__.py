"""Optimizers: the [optim] config (config.py), Muon (muon.py) and the parameter groups of each recipe (groups.py).

Importing the package costs no torch, so trainer/config.py can read optim.config first.
"""
