"""A simulated accelerator for the scale-out benchmark (``bench/scale_bench.py``). Not a test.

``forward`` of a W1-shaped model (64 floats in, one score out) that takes ``BASE_S`` plus
``PER_ROW_S`` a row of wall time and no CPU: it sleeps, which releases the GIL, the way a
CUDA kernel launch and its synchronising copy leave the host idle. Roughly a small model on
one GPU. With it, N scorer processes on a 2-core machine measure the queue and commit tier
(claims, acks, decode, output files), not N models fighting over two cores.

The timings can be changed per process with ``SIM_ACCEL_BASE_S`` and ``SIM_ACCEL_ROW_S``.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

BASE_S = float(os.environ.get("SIM_ACCEL_BASE_S", "0.005"))  # per forward pass
PER_ROW_S = float(os.environ.get("SIM_ACCEL_ROW_S", "0.000002"))  # per row of the batch


class SimulatedAccelerator(nn.Module):
    """W1's interface (``[batch, 64]`` float -> ``[batch, 1]``), an accelerator's timing."""

    batching_input = "dense"
    batching_input_dim = 64
    batching_output_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(BASE_S + PER_ROW_S * x.shape[0])
        return torch.zeros((x.shape[0], 1), dtype=torch.float32)


def build() -> nn.Module:
    """The factory a config names: ``sim_accel:build`` with ``bench/`` on the path."""
    return SimulatedAccelerator()


def rows_per_s(batch: int) -> float:
    """One process's forward-bound ceiling at full batches of ``batch`` rows."""
    return batch / (BASE_S + PER_ROW_S * batch)
