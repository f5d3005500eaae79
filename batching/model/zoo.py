"""Where models come from: built-in models (workloads W1, W2), user factories, pinned checkpoints.

Built-in names map to a factory, an input kind and a checkpoint shipped in
``batching/checkpoints/``. Any other name must be a factory ``package.module:function`` that takes
no arguments and returns a ``torch.nn.Module``. The module declares how it is fed with attributes:

``batching_input``
    ``"dense"`` (default): ``forward(x)`` with ``x`` a float tensor ``[batch, input_dim]``;
    payloads are ``{"x": [input_dim floats]}`` or a tensor of ``input_dim`` values.
    ``"tokens"``: ``forward(tokens, key_padding_mask)`` with ``tokens`` an int64 tensor
    ``[batch, length]`` right-padded with id 0 and ``key_padding_mask`` a bool tensor
    ``[batch, length]``, True at padding; payloads are ``{"tokens": [ids]}`` or an integer tensor.
``batching_input_dim`` (dense only)
    Length of the input vector; default: ``in_features`` of the first ``nn.Linear``.
``batching_vocab_size`` (tokens only)
    Valid ids are ``1 <= id < batching_vocab_size`` (0 is padding); default: ``num_embeddings``
    of the first ``nn.Embedding``, else no upper bound.
``batching_output_dim``
    Floats per item; default: measured by one probe forward at load.

``forward`` must return a tensor whose first dimension is the batch size: one output per input.

Checkpoints are pinned by sha256 and never unpickle code: ``.safetensors`` files, or ``.pt`` /
``.pth`` / ``.bin`` state dicts read with ``torch.load(..., weights_only=True)``. The file is read
once; the bytes that were hashed are the bytes that are loaded.

Why it stays one module: a name, the model it builds and the checkpoint pinned for it are one
contract; ``check`` and the scorer's load go through the same three steps here.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import logging
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from torch import nn

from batching import errors

logger = logging.getLogger(__name__)

InputKind = Literal["dense", "tokens"]
INPUT_KINDS: tuple[InputKind, ...] = ("dense", "tokens")
CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoints"
PICKLE_SUFFIXES = (".pt", ".pth", ".bin")

W1_SEED = 1234
W1_INPUT_DIM = 64
W2_SEED = 5678
W2_VOCAB_SIZE = 30000
W2_D_MODEL = 256


class TabularMLP(nn.Module):
    """W1 "tabular": MLP 64 -> 512 -> ReLU -> 512 -> ReLU -> 1 -> Sigmoid, one score per row.

    Weights come from ``torch.manual_seed(1234)`` at construction; the global RNG state is
    restored afterwards.
    """

    batching_input = "dense"
    batching_input_dim = W1_INPUT_DIM
    batching_output_dim = 1

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(W1_SEED)
            self.net = nn.Sequential(
                nn.Linear(W1_INPUT_DIM, 512),
                nn.ReLU(),
                nn.Linear(512, 512),
                nn.ReLU(),
                nn.Linear(512, 1),
                nn.Sigmoid(),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Score ``x`` [batch, 64] float -> [batch, 1] in (0, 1)."""
        return cast(torch.Tensor, self.net(x))


class TextEncoder(nn.Module):
    """W2 "text": Embedding(30000, 256, padding_idx=0) + 4-layer TransformerEncoder + mean pool.

    Weights come from ``torch.manual_seed(5678)`` at construction; the global RNG state is
    restored afterwards. Output: a 256-float embedding per sequence, the mean over real tokens.
    """

    batching_input = "tokens"
    batching_vocab_size = W2_VOCAB_SIZE
    batching_output_dim = W2_D_MODEL

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(W2_SEED)
            self.embedding = nn.Embedding(W2_VOCAB_SIZE, W2_D_MODEL, padding_idx=0)
            layer = nn.TransformerEncoderLayer(
                d_model=W2_D_MODEL, nhead=4, dim_feedforward=1024, batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)

    def forward(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        """Embed ``tokens`` [batch, length] int64 (True in ``key_padding_mask`` = pad) -> [batch, 256]."""
        hidden = self.encoder(self.embedding(tokens), src_key_padding_mask=key_padding_mask)
        keep = (~key_padding_mask).unsqueeze(-1).to(hidden.dtype)
        return cast(torch.Tensor, (hidden * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0))


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    """A model that ships with the project: factory, input kind and pinned checkpoint."""

    name: str
    factory: Callable[[], nn.Module]
    input_kind: InputKind
    checkpoint: str
    sha256: str
    description: str

    @property
    def checkpoint_path(self) -> Path:
        """Absolute path of the shipped checkpoint file."""
        return CHECKPOINT_DIR / self.checkpoint


BUILTINS: dict[str, BuiltinModel] = {
    "w1-mlp": BuiltinModel(
        name="w1-mlp",
        factory=TabularMLP,
        input_kind="dense",
        checkpoint="w1_mlp_v1.safetensors",
        sha256="5b04a1fa8a14a76fe1daac450b18972b99034b61c79dfdf7bbb5bd09147d86e7",
        description="W1 tabular MLP, 64 floats in, 1 score out (float32 checkpoint)",
    ),
    "w2-text": BuiltinModel(
        name="w2-text",
        factory=TextEncoder,
        input_kind="tokens",
        checkpoint="w2_text_v1.safetensors",
        sha256="66ea2e0212fd60cc52b78d9d744e37f142fe9f02274503e5ee8bfa81b6d0d28f",
        description="W2 text encoder, token ids in, 256 floats out (float16 checkpoint)",
    ),
}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """How the runner feeds a model and what it expects back (None = unknown)."""

    input_kind: InputKind
    input_dim: int | None
    vocab_size: int | None
    output_dim: int | None


def build(name: str) -> tuple[nn.Module, ModelInfo]:
    """Construct a model by built-in name or ``package.module:function`` factory.

    Raises:
        ConfigError: the name is neither built in nor an importable factory, the factory
            raised or did not return an ``nn.Module``, or the module declares a bad input
            kind (the user's code, bad input like the config: ``describe``).
    """
    check_name(name)
    model = BUILTINS[name].factory() if name in BUILTINS else _call_factory(name)
    return model, describe(model, name)


def describe_unloaded(name: str) -> ModelInfo:
    """How the model ``name`` is fed, read from one built on PyTorch's meta device: no
    checkpoint read and no memory for its parameters (the HTTP ingress checks payloads
    against it, in a process that never scores).

    Raises:
        ConfigError: as ``build``; also a factory that cannot build on the meta device (one
            that reads weights while it builds, say).
    """
    check_name(name)
    # Imported first, on the default device: a module's own tensors are not left on meta.
    factory = BUILTINS[name].factory if name in BUILTINS else _factory(name)
    with torch.device("meta"):
        model = _call_factory(name, factory)
    try:
        return describe(model, name)
    except errors.ConfigError:
        raise
    except Exception as exc:  # a declaration read from a weight, say (meta has no values)
        raise errors.ConfigError(
            f"model {name!r} cannot be described without its weights: {errors.one_line(exc)}"
        ) from None


def check_name(name: str) -> None:
    """Raise ``ConfigError`` unless ``name`` is built in or looks like a factory."""
    if name not in BUILTINS and ":" not in name:
        known = ", ".join(sorted(BUILTINS))
        raise errors.ConfigError(
            f"model {name!r} is not built in ({known}); "
            "use a factory written as package.module:function"
        )


def _factory(name: str) -> Callable[[], Any]:
    """The factory ``package.module:function`` names, imported, not called.

    Raises:
        ConfigError: it cannot be imported (naming the error and the fix).
    """
    module_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # ImportError, AttributeError, or the module's own code failing
        raise errors.ConfigError(
            f"model factory {name!r} cannot be imported ({type(exc).__name__}: {exc}); "
            "check the name and that its package is installed"
        ) from None
    if not callable(factory):
        raise errors.ConfigError(f"model factory {name!r} is not a function; name one")
    return cast("Callable[[], Any]", factory)


def _call_factory(name: str, factory: Callable[[], Any] | None = None) -> nn.Module:
    """The module ``name``'s factory (``factory``: imported already) returns."""
    factory = factory or _factory(name)
    try:
        model = factory()
    except Exception as exc:  # the user's code: one line, not their traceback
        raise errors.ConfigError(
            f"model factory {name!r} failed: {errors.one_line(exc)}; fix the factory or model.name"
        ) from None
    if not isinstance(model, nn.Module):
        raise errors.ConfigError(
            f"model factory {name!r} returned {type(model).__name__}, expected a torch.nn.Module"
        )
    return model


def describe(model: nn.Module, name: str = "model") -> ModelInfo:
    """Read a module's ``batching_*`` declarations, inferring what is missing (see module doc).

    Raises:
        ConfigError: ``batching_input`` is not dense/tokens, a ``batching_*`` length is not
            a positive int, or a dense model's input length cannot be found.
    """
    kind = getattr(model, "batching_input", "dense")
    if kind not in INPUT_KINDS:
        raise errors.ConfigError(
            f"{name}: batching_input must be 'dense' or 'tokens', got {kind!r}"
        )
    output_dim = _declared_int(model, "batching_output_dim")
    if kind == "tokens":
        vocab = _declared_int(model, "batching_vocab_size") or _first_embedding_size(model)
        return ModelInfo("tokens", None, vocab, output_dim)
    input_dim = _declared_int(model, "batching_input_dim") or _first_linear_in(model)
    if input_dim is None:
        raise errors.ConfigError(
            f"{name}: cannot tell the input length of this dense model; "
            "set batching_input_dim on the module"
        )
    return ModelInfo("dense", input_dim, None, output_dim)


def _declared_int(model: nn.Module, attr: str) -> int | None:
    value = getattr(model, attr, None)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise errors.ConfigError(f"{attr} must be a positive int, got {value!r}")
    return value


def _first_linear_in(model: nn.Module) -> int | None:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            return int(module.in_features)
    return None


def _first_embedding_size(model: nn.Module) -> int | None:
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return int(module.num_embeddings)
    return None


def checkpoint_path(name: str, checkpoint: str | None, base_dir: Path) -> Path:
    """The checkpoint file: ``checkpoint`` relative to ``base_dir``, else the built-in's file.

    Raises:
        ConfigError: ``name`` is neither built in nor a factory.
        CheckpointError: no checkpoint is set and ``name`` is not built in.
    """
    check_name(name)
    if checkpoint is not None:
        path = Path(checkpoint).expanduser()
        return path if path.is_absolute() else base_dir / path
    if name in BUILTINS:
        return BUILTINS[name].checkpoint_path
    raise errors.CheckpointError(
        f"model {name!r} is not built in, so it needs a checkpoint: set model.checkpoint "
        "to a .safetensors file and model.sha256 to its digest"
    )


def load_checkpoint(path: Path, sha256: str) -> dict[str, torch.Tensor]:
    """Read ``path``, verify its sha256, and return its state dict (CPU tensors).

    Raises:
        CheckpointError: the file is missing, its digest is not ``sha256``, its format is not
            supported, it needs arbitrary unpickling, or it does not hold a state dict.
    """
    return _as_state_dict(_deserialize(read_pinned(path, sha256), path), path)


def read_pinned(path: Path, sha256: str) -> bytes:
    """The bytes of ``path`` if their sha256 is ``sha256`` (nothing is deserialized).

    Raises:
        CheckpointError: the file is missing or unreadable, or its digest is another.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise errors.CheckpointError(
            f"checkpoint {path} cannot be read ({exc.strerror}); check model.checkpoint"
        ) from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256.lower():
        raise errors.CheckpointError(
            f"checkpoint {path} has sha256 {actual} but the config pins {sha256.lower()}; "
            "restore the pinned file, or if this file is the one to run set the sha256 that "
            "pins it (model.sha256, or its model_versions entry's) to its digest and give it "
            "a new version"
        )
    return data


def _deserialize(data: bytes, path: Path) -> object:
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        try:
            return load_safetensors(data)
        except SafetensorError as exc:
            raise errors.CheckpointError(
                f"checkpoint {path} is not valid safetensors ({exc})"
            ) from None
    if suffix in PICKLE_SUFFIXES:
        return _torch_load_weights(data, path)
    raise errors.CheckpointError(
        f"checkpoint {path} has an unsupported format {suffix!r}; "
        f"use .safetensors (preferred) or a state dict saved as {'/'.join(PICKLE_SUFFIXES)}"
    )


def _torch_load_weights(data: bytes, path: Path) -> object:
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol 4": two lines before ours
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # The weights-only unpickler names the class it will not build ("Unsupported global");
        # any other complaint (an unknown opcode, a truncated stream) is a damaged file.
        if "unsupported global" in str(exc).lower():
            raise errors.CheckpointError(
                f"checkpoint {path} refused: it needs arbitrary unpickling (a pickled module "
                "or custom object), which can run code; save model.state_dict() with "
                "safetensors.torch.save_file instead"
            ) from None
        raise errors.CheckpointError(
            f"checkpoint {path} is not a readable torch state dict (corrupt, or another "
            "format); save model.state_dict() with safetensors.torch.save_file"
        ) from None
    except Exception as exc:  # torch.load on damaged bytes: RuntimeError, EOFError, IndexError...
        raise errors.CheckpointError(
            f"checkpoint {path} cannot be read by torch.load ({_one_line(exc)})"
        ) from None


def _as_state_dict(obj: object, path: Path) -> dict[str, torch.Tensor]:
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise errors.CheckpointError(
            f"checkpoint {path} does not hold a state dict (names -> tensors); "
            "save model.state_dict()"
        )
    return obj


def shape_of(name: str) -> ModelInfo | None:
    """What model ``name`` takes and gives, built on the meta device (no weights, nothing
    computed); None when it cannot be built there (its factory computes on its tensors).

    Raises:
        ConfigError: ``name`` is neither built in nor an importable factory.
    """
    require_importable(name)
    try:
        with torch.device("meta"):
            return build(name)[1]
    except Exception:
        return None


def require_importable(name: str) -> None:
    """Import ``name``'s factory (a model not built in), without building it.

    Raises:
        ConfigError: it cannot be imported.
    """
    if name not in BUILTINS:
        _factory(name)


def check_fits(name: str, state: dict[str, torch.Tensor], path: Path) -> bool:
    """Whether ``state`` loads into model ``name`` (strict names and shapes), the model built
    on the meta device: no memory for its weights and none computed. False when its factory
    cannot be built there (it computes on its tensors): not checked, the scorer's load will.

    Raises:
        ConfigError: ``name`` is a factory that cannot be imported (a check that passed it
            let every item routed to it go dead at the first score).
        CheckpointError: names or shapes do not match the model.
    """
    if name not in BUILTINS:
        _factory(name)
    try:
        with torch.device("meta"):
            model, _ = build(name)
    except Exception:
        return False
    load_state(model, state, path, assign=True)  # meta parameters take the file's tensors
    return True


def load_state(
    model: nn.Module, state: dict[str, torch.Tensor], path: Path, *, assign: bool = False
) -> None:
    """Copy ``state`` into ``model`` (strict names and shapes; dtypes are converted), or
    with ``assign`` make its tensors the model's.

    Raises:
        CheckpointError: names or shapes do not match the model.
    """
    try:
        model.load_state_dict(state, strict=True, assign=assign)
    except RuntimeError as exc:
        raise errors.CheckpointError(
            f"checkpoint {path} does not fit the model ({_one_line(exc, 400)}); "
            "check model.name and model.checkpoint"
        ) from None


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
