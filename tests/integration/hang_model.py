"""A model factory for real-process tests: W1's MLP (its shipped checkpoint loads into it),
whose forward pass never returns for a row whose first value is :data:`HANG_AT`.

It waits in native code (a lock never released), where no interrupt lands, as a stuck kernel
would. Being a factory (``model.name: tests.integration.hang_model:build``), it hangs in
every process that builds the model: the workers of ``score --workers N`` are spawned, and
no patch of the parent (``die_on.py``) reaches them. The model's own probe input holds no
such row, so the probe scores.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from batching.model import zoo

HANG_AT = 4242.0


class HangingW1(zoo.TabularMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] == HANG_AT).any()):
            threading.Event().wait()
        return super().forward(x)


def build() -> nn.Module:
    return HangingW1()
