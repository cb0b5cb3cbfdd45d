"""Run at every start-up of an interpreter with this folder on PYTHONPATH: torch 2.11's surface (tests/torch_211.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for torch_211
import torch_211  # noqa: E402

torch_211.apply()
