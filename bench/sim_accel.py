"""A simulated accelerator for the scale-out benchmark (``bench/scale_bench.py``). Not a test.

``forward`` of a W1-shaped model (64 floats in, one score out) that takes ``BASE_S`` plus
``PER_ROW_S`` a row of wall time and no CPU: it sleeps, which releases the GIL, the way a
CUDA kernel launch and its synchronising copy leave the host idle. Roughly a small model on
one GPU. With it, N scorer processes on a 2-core machine measure the queue and commit tier
(claims, acks, decode, output files), not N models fighting over two cores.

The timings can be changed per process with ``SIM_ACCEL_BASE_S`` and ``SIM_ACCEL_ROW_S``.

``build_text`` is the same for W2 (``bench/online_bench.py --sim-accel``): token ids and a
padding mask in, 256 floats an item out, a pass as long as W2's CPU service profile
(``deployments/profiles/w2-text-cpu.json``) predicts for its size and padded length, times
``SIM_ACCEL_W2_SCALE`` (default 1: the CPU's pace without its cores), asleep. Over HTTP it
shows what the scheduler and the ingress do when the model does not share the host's cores.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from batching.model.zoo import W2_D_MODEL, W2_VOCAB_SIZE  # the library beside this script

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


W2_PROFILE = Path(__file__).resolve().parents[1] / "deployments/profiles/w2-text-cpu.json"
W2_SCALE = float(os.environ.get("SIM_ACCEL_W2_SCALE", "1.0"))


@functools.cache
def _w2_seconds() -> Callable[[int, int], float]:
    from batching.plan.profile import ServiceProfile

    return ServiceProfile.load(W2_PROFILE).predict


class SimulatedTextAccelerator(nn.Module):
    """W2's interface (``[batch, length]`` int64 ids and a padding mask -> ``[batch, 256]``
    floats), a pass as long as W2's CPU profile predicts, asleep."""

    batching_input = "tokens"
    batching_vocab_size = W2_VOCAB_SIZE
    batching_output_dim = W2_D_MODEL

    def forward(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        n, length = tokens.shape
        predict = _w2_seconds()
        time.sleep(W2_SCALE * predict(int(n), int(length)))
        return torch.zeros((n, self.batching_output_dim), dtype=torch.float32)


def checkpoint(folder: Path) -> tuple[str, str]:
    """An empty safetensors file in ``folder`` (a simulated model has no weights) and its
    sha256, for the config to pin: (path, sha256)."""
    path = folder / "sim-accel.safetensors"
    if not path.exists():
        save_file({}, str(path))
    return str(path), hashlib.sha256(path.read_bytes()).hexdigest()


def build_text() -> nn.Module:
    """The factory of W2's simulated accelerator: ``sim_accel:build_text``."""
    return SimulatedTextAccelerator()


def build() -> nn.Module:
    """The factory a config names: ``sim_accel:build`` with ``bench/`` on the path."""
    return SimulatedAccelerator()


def rows_per_s(batch: int) -> float:
    """One process's forward-bound ceiling at full batches of ``batch`` rows."""
    return batch / (BASE_S + PER_ROW_S * batch)
