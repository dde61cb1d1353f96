"""The one-shot GPU check: `python -m scripts.gpu_check` (runner.py), its probe of train.py (probe.py) and the
kernel check (kernels.py)."""
