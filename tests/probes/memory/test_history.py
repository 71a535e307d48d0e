"""The CUDA allocator's history context manager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eventbus_debug.probes import cuda_memory_history


def test_cuda_memory_history_is_a_no_op_without_cuda(tmp_path: Path) -> None:
    """Without CUDA nothing is recorded; max_entries must be bounded."""
    with pytest.raises(ValueError, match="max_entries"):
        with cuda_memory_history(str(tmp_path / "s.pickle"), max_entries=0):
            pass
    if not torch.cuda.is_available():
        with cuda_memory_history(str(tmp_path / "s.pickle")) as recording:
            assert recording is False
