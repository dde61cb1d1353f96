"""The one-shot GPU check: `python -m scripts.gpu_check` (runner.py), its probe of train.py (probe.py), the
kernel check (kernels.py), each check's size and time (sizes.py) and the verdicts on what they measured
(verdicts.py)."""
