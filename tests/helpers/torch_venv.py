"""The PyTorch virtualenv the torch tests run their jobs in (``make torch-setup``; ``TORCH_VENV`` overrides)."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TORCH_PYTHON = Path(os.environ.get("TORCH_VENV", REPO / ".venv-torch")) / "bin" / "python"
needs_torch_venv = pytest.mark.skipif(
    not TORCH_PYTHON.exists(), reason=f"no PyTorch venv at {TORCH_PYTHON}: make torch-setup"
)
