"""`python -m scripts.gpu_check`: see runner.py."""
import sys

from scripts.gpu_check.runner import main

sys.exit(main())
