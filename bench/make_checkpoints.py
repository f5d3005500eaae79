"""Write the shipped checkpoints of the built-in models and print their sha256.

Run from the repository root: ``python bench/make_checkpoints.py`` (``--check`` only compares the
files on disk with freshly built bytes, for CI).

W1 is stored in float32 (1.2 MB). W2 is stored in float16 (~21.7 MB instead of ~43 MB) so the
repository stays small; the runner upcasts it to the configured dtype (float32 by default) at
load, so the shipped W2 weights are the seeded float32 weights rounded to float16 (relative error
below 5e-4). The file, not the seed, is the pinned truth: its sha256 goes in the config.
The bytes are deterministic: same seed, same torch initialisers, safetensors' stable layout.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch
from safetensors.torch import save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batching.model import zoo

STORAGE_DTYPES = {"w1-mlp": torch.float32, "w2-text": torch.float16}


def checkpoint_bytes(name: str) -> bytes:
    """Serialised state dict of built-in ``name`` in its storage dtype."""
    model = zoo.BUILTINS[name].factory()
    dtype = STORAGE_DTYPES[name]
    state = {
        key: value.detach().to(dtype).contiguous() for key, value in model.state_dict().items()
    }
    # One metadata key only: safetensors writes several keys in hash order, not stable bytes.
    storage = str(dtype).removeprefix("torch.")
    return save(state, metadata={"batching": f"model={name} storage_dtype={storage}"})


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` verify) every built-in checkpoint; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    status = 0
    zoo.CHECKPOINT_DIR.mkdir(parents=True, exist_ok=True)
    for name, builtin in zoo.BUILTINS.items():
        data = checkpoint_bytes(name)
        digest = hashlib.sha256(data).hexdigest()
        path = builtin.checkpoint_path
        if args.check:
            same = path.is_file() and path.read_bytes() == data
            status |= 0 if same else 1
            print(f"{'ok  ' if same else 'DIFF'} {digest}  {path.name}")
            continue
        path.write_bytes(data)
        print(f"{digest}  {path.name}  ({len(data) / 1e6:.1f} MB)")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
