"""TorchRunner: a pinned model on one device; decode, collate, forward, split on OOM, isolate poison.

``decode`` is CPU-only and thread-safe, so the pipeline can decode and collate batch N+1 in a
worker thread while ``forward`` runs batch N (call ``forward`` from one thread). Outputs are keyed
by ``WorkItem.id`` and never ordered.

Failure handling inside ``forward``, per (sub-)batch:

- CUDA out of memory: split in half and retry; the runner remembers the size that was tried
  next (``oom_ceiling``, in padded units) and chunks every later batch to it.
- the model broke its contract (not one output per input, wrong width), or raised: bisect,
  so a poison item fails alone with the message and its batch-mates still get outputs (a
  contract broken by one item alone sets ``outcomes.ScoreResult.batch_error``). When every
  item of a batch of two or more fails so (no single poison: the model, not an item, is
  broken), ``ScoreResult.whole_batch_error`` says so, for the scoring loop's retry-storm
  breaker, which asks :meth:`TorchRunner.healthy` before it believes it.
- a row whose output is not finite is scored again alone; only an item whose output is not
  finite alone fails (and counts as the model's failure for the breaker).

Why it stays one module: it is the only one that imports torch; loading, decoding,
collating, the forward pass with its OOM split and poison bisection, and measuring a profile
share the device, the dtype and the model's contract checks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from batching import errors, models, outcomes
from batching.model import payloads, zoo
from batching.plan.profile import ProfilePoint, ServiceProfile

if TYPE_CHECKING:  # read by attribute only: bench/gpu_check.py runs without pydantic
    from batching.config import ModelSpec

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
FloatArray = payloads.FloatArray
IntArray = payloads.IntArray


@dataclass(frozen=True, slots=True, eq=False)
class Decoded:
    """A collated batch on the host, ready for ``forward``.

    Row ``i`` of ``inputs`` belongs to item ``ids[i]``. Dense: ``inputs`` is ``[n, input_dim]`` in
    the model dtype. Tokens: ``inputs`` is ``[n, L]`` int64 right-padded with 0 and ``mask`` is
    ``[n, L]`` bool, True at padding. ``lengths`` are real lengths (1 per dense row). Items that
    did not decode are in ``failures`` (id -> one-line reason) and have no row.
    """

    ids: tuple[int, ...]
    inputs: torch.Tensor
    mask: torch.Tensor | None
    lengths: IntArray
    failures: dict[int, str]

    @property
    def real_tokens(self) -> int:
        """Sum of real lengths (rows for dense inputs)."""
        return int(self.lengths.sum())

    @property
    def padded_tokens(self) -> int:
        """Rows x padded length (rows for dense inputs)."""
        return len(self.ids) * (int(self.lengths.max()) if len(self.ids) else 0)


@dataclass(slots=True)
class _Tally:
    outputs: dict[int, FloatArray] = field(default_factory=dict)
    chunks: list[tuple[Sequence[int], FloatArray]] = field(default_factory=list)  # all finite
    failures: dict[int, str] = field(default_factory=dict)
    batch_error: str | None = None
    n_forward: int = 0
    model_failed: int = 0  # items failed in the model, alone (an error, or not finite)
    first_error: str | None = None
    n_oom_splits: int = 0
    bisected: bool = False  # a forward failure (not an OOM) split the batch
    poisoned: set[int] = field(default_factory=set)
    contract_error: str | None = None  # a batch broke the contract, and was bisected
    contract_alone: int = 0  # items that broke it alone


class TorchRunner:
    """A checksum-verified model in eval mode on one device (see module doc)."""

    def __init__(
        self, spec: ModelSpec, model: nn.Module, info: zoo.ModelInfo, device: torch.device
    ) -> None:
        """Wrap an already loaded model; use :meth:`load` instead."""
        self.spec = spec
        self._model = model
        self._info = info
        self._device = device
        self._dtype = DTYPES[spec.dtype]
        self._pin = device.type == "cuda"
        self._autocast_dtype = AUTOCAST.get(spec.autocast) if device.type == "cuda" else None
        self._ceiling: int | None = None
        self._memory: ItemMemory | None = None  # set by load() when a budget applies

    @classmethod
    def load(cls, spec: ModelSpec, base_dir: Path | str = ".") -> TorchRunner:
        """Verify the pinned checkpoint, build the model, load weights, move it to its device.

        Raises:
            CheckpointError: missing file, sha256 mismatch, unsafe or unfitting checkpoint.
            ConfigError: unknown model name, unimportable or failing factory, one that
                returned something unusable, no CUDA when asked.
        """
        started = time.perf_counter()
        path = zoo.checkpoint_path(spec.name, spec.checkpoint, Path(base_dir))
        state = zoo.load_checkpoint(path, spec.sha256)
        model, info = zoo.build(spec.name)
        zoo.load_state(model, state, path)
        device = _pick_device(spec.device)
        model.to(device=device, dtype=DTYPES[spec.dtype]).eval()
        runner = cls(spec, model, info, device)
        if info.output_dim is None:
            runner._info = replace(info, output_dim=runner._probe_output_dim())
        runner._memory = runner._measure_memory()
        if spec.autocast != "none" and device.type != "cuda":
            logger.warning("autocast ignored on cpu", extra={"action": "autocast_ignored"})
        logger.info(
            "model loaded",
            extra={
                "action": "model_loaded",
                "model": spec.name,
                "model_version": spec.version,
                "sha256": spec.sha256,
                "device": str(device),
                "duration_s": time.perf_counter() - started,
            },
        )
        return runner

    @property
    def model(self) -> nn.Module:
        """The wrapped module (eval mode, on :attr:`device`)."""
        return self._model

    @property
    def device(self) -> torch.device:
        """The device chosen at load."""
        return self._device

    @property
    def input_kind(self) -> zoo.InputKind:
        """``"dense"`` or ``"tokens"``."""
        return self._info.input_kind

    @property
    def input_dim(self) -> int | None:
        """Floats per dense input (None for token models)."""
        return self._info.input_dim

    @property
    def vocab_size(self) -> int | None:
        """Token ids must be below this (None: no upper bound, or a dense model)."""
        return self._info.vocab_size

    @property
    def output_dim(self) -> int:
        """Floats per item output."""
        assert self._info.output_dim is not None  # set at load
        return self._info.output_dim

    @property
    def model_name(self) -> str:
        """Built-in name or factory of the model."""
        return self.spec.name

    @property
    def model_version(self) -> str:
        """The pinned model version from the config."""
        return self.spec.version

    @property
    def checksum(self) -> str:
        """sha256 of the checkpoint that was verified and loaded."""
        return self.spec.sha256

    @property
    def cpu_threads(self) -> int:
        """torch's CPU threads in this process (on CPU, the passes' reduction order, so their
        bits, depend on it)."""
        return int(torch.get_num_threads())

    @property
    def oom_ceiling(self) -> int | None:
        """Largest sub-batch, in padded units (rows; rows x length for tokens), after a CUDA OOM.

        None until the first out-of-memory; later batches are chunked to it.
        """
        return self._ceiling

    @property
    def device_name(self) -> str:
        """Human-readable device: the GPU's name, or ``cpu (N threads)``."""
        if self._device.type == "cuda":
            return str(torch.cuda.get_device_name(self._device))
        return f"cpu ({torch.get_num_threads()} threads)"

    @property
    def device_memory_bytes(self) -> int | None:
        """Total memory of the GPU, None on CPU."""
        if self._device.type != "cuda":
            return None
        return int(torch.cuda.get_device_properties(self._device).total_memory)

    # ---- decode (CPU, thread-safe) ---------------------------------------------------------

    def decode(self, items: Sequence[models.WorkItem]) -> Decoded:
        """Decode and collate payloads on the host; bad payloads fail alone with a reason.

        JSON payloads are ``{"x": [input_dim numbers]}`` (dense) or ``{"tokens": [ids]}``;
        tensor payloads are little-endian bytes with a numpy ``dtype`` and a ``shape`` of
        ``(n,)`` or ``(1, n)``. On CUDA the tensors are in pinned memory.
        """
        big = self._oversized(items)
        if big:  # not parsed at all: a 50 MB payload held 9 GB once decoded
            kept = [item for item in items if item.id not in big]
            decoded = self.decode(kept)
            return replace(decoded, failures={**decoded.failures, **big})
        if self._info.input_kind == "dense":
            decoded = self._decode_dense(items)
        else:
            decoded = self._decode_tokens(items)
        if self._pin and len(decoded.ids):
            mask = decoded.mask.pin_memory() if decoded.mask is not None else None
            decoded = replace(decoded, inputs=decoded.inputs.pin_memory(), mask=mask)
        return decoded

    def _decode_dense(self, items: Sequence[models.WorkItem]) -> Decoded:
        dim = self._info.input_dim
        assert dim is not None  # dense models always know it (zoo.describe)
        if isinstance(items, models.ItemBlock) and len(items):
            matrix = payloads.block_rows(items, dim)
            if matrix is not None:
                return _dense_decoded(tuple(items.ids), matrix, {}, self._dtype)
        rows, failures = payloads.dense_rows(items, dim)
        if not failures and len(rows) == 1:  # the common case: one block, every item, in order
            matrix = rows[0][1]
            ids = tuple(item.id for item in items)
        else:
            ok = [i for i, item in enumerate(items) if item.id not in failures]
            matrix = np.empty((len(ok), dim), dtype=np.float32)
            for positions, block in rows:
                matrix[np.searchsorted(ok, positions)] = block
            ids = tuple(items[i].id for i in ok)
        return _dense_decoded(ids, matrix, failures, self._dtype)

    def _decode_tokens(self, items: Sequence[models.WorkItem]) -> Decoded:
        seqs: list[IntArray] = []
        ids: list[int] = []
        failures: dict[int, str] = {}
        for item in items:
            seq, reason = payloads.token_seq(item.payload)
            if reason is None and seq is not None:
                reason = payloads.token_range_error(seq, self._info.vocab_size)
            if reason is None and seq is not None:
                reason = self._too_long(len(seq))
            if reason is not None or seq is None:
                failures[item.id] = reason or "payload has no tokens"
                continue
            seqs.append(seq)
            ids.append(item.id)
        tokens, mask, lengths = _collate(seqs)
        return Decoded(tuple(ids), tokens, mask, lengths, failures)

    def _oversized(self, items: Sequence[models.WorkItem]) -> dict[int, str]:
        """Items whose stored payload is over ``model.max_item_bytes``, with the reason."""
        most = self.spec.max_item_bytes
        if isinstance(items, models.ItemBlock) and items.item_nbytes <= most:
            return {}  # one size for all: no item built per row
        return {
            item.id: f"payload is {len(item.payload.data)} bytes, over model.max_item_bytes {most}"
            for item in items
            if len(item.payload.data) > most
        }

    def _too_long(self, length: int) -> str | None:
        """Why an item of ``length`` tokens cannot be scored here (limit or memory), or None."""
        if length > self.spec.max_item_tokens:
            return f"{length} tokens, over model.max_item_tokens {self.spec.max_item_tokens}"
        memory = self._memory
        if memory is not None and memory.batch(1, length) > memory.budget:
            return (
                f"{length} tokens need about {memory.batch(1, length) / 2**20:.1f} MiB of "
                f"device memory alone (estimated), over the memory budget of "
                f"{memory.budget / 2**20:.1f} MiB ({memory.source}); the device can take "
                f"{memory.longest()} tokens at most: split the item or lower "
                "model.max_item_tokens"
            )
        return None

    def _measure_memory(self) -> ItemMemory | None:
        """The per-item memory curve, measured on single-item probes, and the budget a batch
        must fit: ``model.memory_budget_bytes``, else 90% of the GPU's memory left after the
        weights; None on cpu without a budget (host memory is not the device's)."""
        budget, source = self.spec.memory_budget_bytes, "model.memory_budget_bytes"
        if budget is None and self._device.type == "cuda":
            props = torch.cuda.get_device_properties(self._device)
            free = props.total_memory - torch.cuda.memory_allocated(self._device)
            budget, source = int(0.9 * free), "90% of the GPU memory left after the weights"
        if budget is None or self._info.input_kind == "dense":
            return None  # a dense item is one fixed-size row: the OOM split is enough
        lengths = (32, 64, 128)
        peaks = [self._probe_peak(length) for length in lengths]
        return ItemMemory.fit(lengths, peaks, budget, source, self.spec.max_item_tokens)

    def _probe_peak(self, length: int) -> int:
        """Peak bytes one item of ``length`` allocates in a forward pass (on cpu: the live
        tensors the ops return, a lower bound that misses fused kernels' scratch)."""
        decoded = self.decode(self.synthetic_items(1, length))
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            base = torch.cuda.memory_allocated(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
            self._forward_rows(decoded, 0, 1)
            return max(1, int(torch.cuda.max_memory_allocated(self._device)) - base)
        counter = _PeakBytes()
        with counter:
            self._forward_rows(decoded, 0, 1)
        return max(1, counter.peak)

    # ---- forward (model thread) ------------------------------------------------------------

    def forward(self, decoded: Decoded) -> outcomes.ScoreResult:
        """Run the model on a decoded batch (see module doc for OOM, poison and contract rules).

        Returns:
            One entry per input item, in ``outputs`` or ``failures``.
        """
        started = time.perf_counter()
        tally = _Tally(failures=dict(decoded.failures))
        for start, stop in self._plan(decoded):
            self._run_range(decoded, start, stop, tally)
        by_batches = tally.contract_error is not None and not tally.contract_alone
        if by_batches:
            self._batched_contract_broken(decoded, tally)
        outputs: Mapping[int, FloatArray] = tally.outputs
        if len(tally.chunks) == 1 and not outputs:  # the whole batch, scored at once
            outputs = models.OutputRows(*tally.chunks[0])
        else:
            for ids, out in tally.chunks:
                tally.outputs.update(zip(ids, out, strict=True))
        whole = (
            tally.first_error
            if len(decoded.ids) > 1 and tally.model_failed == len(decoded.ids)
            else None
        )
        return outcomes.ScoreResult(
            outputs=outputs,
            failures=tally.failures,
            service_s=time.perf_counter() - started,
            real_tokens=decoded.real_tokens,
            padded_tokens=decoded.padded_tokens,
            batch_error=tally.batch_error,
            n_forward=tally.n_forward,
            undecodable=frozenset(decoded.failures),
            whole_batch_error=whole,
            n_oom_splits=tally.n_oom_splits,
            # a batch failing as a whole is the model's fault, not its items' (the breaker's)
            poisoned=frozenset() if whole else frozenset(tally.poisoned),
            model_at_fault=by_batches,
        )

    def score(self, items: Sequence[models.WorkItem]) -> outcomes.ScoreResult:
        """``forward(decode(items))``."""
        return self.forward(self.decode(items))

    def _plan(self, decoded: Decoded) -> list[tuple[int, int]]:
        """Row ranges to run: the whole batch, or chunks within the OOM ceiling."""
        n = len(decoded.ids)
        if n == 0:
            return []
        memory = self._memory
        if self._ceiling is None and (
            memory is None or memory.batch(n, int(decoded.lengths.max())) <= memory.budget
        ):
            return [(0, n)]
        ceiling = self._ceiling if self._ceiling is not None else 2**62
        ranges, start, widest = [], 0, 0
        for i, length in enumerate(decoded.lengths.tolist()):
            rows, width = i + 1 - start, max(widest, length)
            over = memory is not None and memory.batch(rows, width) > memory.budget
            if i > start and (rows * width > ceiling or over):
                ranges.append((start, i))
                start, widest = i, 0
            widest = max(widest, length)
        ranges.append((start, n))
        return ranges

    def _run_range(self, decoded: Decoded, start: int, stop: int, tally: _Tally) -> None:
        tally.n_forward += 1
        contract = False
        try:
            out = self._forward_rows(decoded, start, stop)
        except errors.ModelError as exc:  # a broken contract: one item's (isolate it) or all's
            oom, reason, contract = False, str(exc), True
        except Exception as exc:  # the model's own error: isolate it below
            oom, reason = _is_oom(exc), errors.one_line(exc)
        else:
            self._collect(decoded, start, stop, out, tally)
            return
        if contract:
            tally.contract_error = tally.contract_error or reason
        if stop - start == 1:
            if contract:
                tally.contract_alone += 1
                self._contract_broken(decoded, start, stop, tally, reason)
            else:
                self._item_failed(decoded.ids[start], reason, tally, oom)
            return
        mid = (start + stop) // 2
        if oom:
            tally.n_oom_splits += 1
            self._lower_ceiling(decoded, start, mid, stop)
        else:
            tally.bisected = True
            logger.warning(
                "forward failed; bisecting",
                extra={"action": "forward_bisect", "n_items": stop - start, "error": reason},
            )
        self._run_range(decoded, start, mid, tally)
        self._run_range(decoded, mid, stop, tally)

    def _forward_rows(self, decoded: Decoded, start: int, stop: int) -> FloatArray:
        n = stop - start
        with torch.inference_mode(), self._autocast():
            if decoded.mask is None:
                x = decoded.inputs[start:stop].to(self._device, non_blocking=True)
                out = self._model(x)
            else:
                width = int(decoded.lengths[start:stop].max())
                tokens = decoded.inputs[start:stop, :width].to(self._device, non_blocking=True)
                mask = decoded.mask[start:stop, :width].to(self._device, non_blocking=True)
                out = self._model(tokens, mask)
            return self._check_output(out, n)

    def _check_output(self, out: object, n: int) -> FloatArray:
        """Validate the model's output for ``n`` inputs; float32 ``[n, output_dim]`` on host."""
        if not isinstance(out, torch.Tensor):
            raise errors.ModelError(f"model returned {type(out).__name__}, expected a Tensor")
        if out.dim() == 0 or out.shape[0] != n:
            got = 0 if out.dim() == 0 else out.shape[0]
            raise errors.ModelError(
                f"model returned {got} outputs for {n} inputs; it must return one per input"
            )
        flat = out.reshape(n, -1)
        expected = self._info.output_dim
        if expected is not None and flat.shape[1] != expected:
            raise errors.ModelError(
                f"model returned {flat.shape[1]} values per item, expected {expected}"
            )
        return flat.detach().to(torch.float32).cpu().numpy()

    def _autocast(self) -> AbstractContextManager[Any]:
        if self._autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type="cuda", dtype=self._autocast_dtype)

    def _collect(
        self, decoded: Decoded, start: int, stop: int, out: FloatArray, tally: _Tally
    ) -> None:
        """Keep the finite rows; a row that is not finite is scored again alone before its
        item is charged (one item's NaN can spread to its batch-mates' rows, through a norm
        or attention over the batch), and fails only if it is not finite alone either: then
        it counts as a model failure, so a model that gives NaN for everything (a checkpoint
        with NaN weights) fails batches whole, as the breaker needs to see."""
        ids = decoded.ids[start:stop]
        if np.isfinite(out).all():  # whole: ~7x cheaper than by row, the common case
            tally.chunks.append((ids, out))
            return
        finite = np.asarray(np.isfinite(out).all(axis=1), dtype=np.bool_)
        logger.warning(
            "non-finite outputs",
            extra={"action": "non_finite_output", "n_items": int((~finite).sum())},
        )
        if stop - start > 1:
            for offset, (item_id, row, ok) in enumerate(zip(ids, out, finite, strict=True)):
                if ok:
                    tally.outputs[item_id] = row
                else:
                    self._run_range(decoded, start + offset, start + offset + 1, tally)
            return
        tally.failures[ids[0]] = "model output is not finite (NaN or inf), for this item alone"
        tally.model_failed += 1
        tally.first_error = tally.first_error or "model output is not finite (NaN or inf)"

    def healthy(self) -> bool:
        """Whether the model scores synthetic inputs of its own kind, finite: what the
        breaker asks before it calls a streak of failing batches a broken model rather than a
        run of poison items (the model works on its own probe, so they failed on theirs)."""
        try:
            result = self.forward(self.decode(self.synthetic_items(1, length=8)))
        except Exception:
            return False
        return len(result.outputs) == 1 and not result.failures

    def _contract_broken(
        self, decoded: Decoded, start: int, stop: int, tally: _Tally, reason: str
    ) -> None:
        logger.error(
            "model broke its contract",
            extra={"action": "model_contract_broken", "n_items": stop - start, "error": reason},
        )
        tally.batch_error = reason
        for item_id in decoded.ids[start:stop]:
            tally.failures[item_id] = reason
            if tally.bisected:  # found alone: a poison item, as a raising one would be
                tally.poisoned.add(item_id)
        tally.model_failed += stop - start
        tally.first_error = tally.first_error or reason

    def _batched_contract_broken(self, decoded: Decoded, tally: _Tally) -> None:
        """A contract broken by batches but by no item alone (a model that drops a row of any
        batch past one): the model's fault. Every item the model saw fails with the reason,
        outputs of the single-item passes included, so the batch fails whole for the breaker
        rather than scoring item by item at 2n - 1 forward calls a batch unseen."""
        reason = tally.contract_error or "model broke its contract"
        tally.chunks.clear()
        tally.outputs.clear()
        for item_id in decoded.ids:
            tally.failures.setdefault(item_id, reason)
        tally.batch_error = reason
        tally.model_failed = len(decoded.ids)
        tally.first_error = reason
        tally.poisoned.clear()

    def _item_failed(self, item_id: int, reason: str, tally: _Tally, oom: bool) -> None:
        if oom:
            reason = f"CUDA out of memory even for this item alone ({reason})"
        logger.warning(
            "item failed in forward",
            extra={"action": "item_failed", "item_id": item_id, "error": reason},
        )
        tally.failures[item_id] = reason
        tally.model_failed += 1
        tally.first_error = tally.first_error or reason
        if tally.bisected and not oom:
            tally.poisoned.add(item_id)

    def _lower_ceiling(self, decoded: Decoded, start: int, mid: int, stop: int) -> None:
        half = (mid - start) * int(decoded.lengths[start:mid].max())
        self._ceiling = half if self._ceiling is None else min(self._ceiling, half)
        logger.warning(
            "cuda out of memory; splitting batch",
            extra={"action": "oom_split", "n_items": stop - start, "oom_ceiling": self._ceiling},
        )

    # ---- synthetic inputs, warm-up ---------------------------------------------------------

    def synthetic_items(
        self, n_items: int, length: int = 16, seed: int = 0
    ) -> tuple[models.WorkItem, ...]:
        """``n_items`` random tensor-payload items of the right kind (``length`` tokens each)."""
        rng = np.random.default_rng(seed)
        rows: npt.NDArray[Any]
        if self._info.input_kind == "dense":
            assert self._info.input_dim is not None
            rows = rng.standard_normal((n_items, self._info.input_dim), dtype=np.float32)
        else:
            high = self._info.vocab_size or 1000
            rows = rng.integers(1, high, size=(n_items, length), dtype=np.int64)
        return tuple(
            models.WorkItem(
                id=i,
                item_key=f"synthetic-{i}",
                payload=models.Payload(
                    row.tobytes(), models.PayloadFormat.TENSOR, str(row.dtype), row.shape
                ),
                enqueued_at=0.0,
            )
            for i, row in enumerate(rows)
        )

    def warmup(self, batch_size: int = 8, length: int = 32, repeats: int = 2) -> float:
        """Run a few synthetic batches (allocator, kernels); returns the last one's seconds."""
        decoded = self.decode(self.synthetic_items(batch_size, length))
        seconds = 0.0
        for _ in range(repeats):
            seconds = self.forward(decoded).service_s
        logger.info("model warmed up", extra={"action": "model_warmed_up", "duration_s": seconds})
        return seconds

    def _probe_output_dim(self) -> int:
        decoded = self.decode(self.synthetic_items(1, length=8))
        return int(self._forward_rows(decoded, 0, 1).shape[1])


def measure_profile(
    runner: TorchRunner,
    batch_sizes: Sequence[int] = (1, 8, 32, 128),
    lengths: Sequence[int] = (16, 64, 128),
    repeats: int = 5,
) -> ServiceProfile:
    """Measure forward seconds (median of ``repeats``) for each batch size x length.

    Synthetic inputs of the runner's kind; each shape runs once unmeasured first. Dense models
    use length 1 whatever ``lengths`` says. On CUDA the peak allocated memory is recorded too.

    Raises:
        ModelError: the model failed on synthetic inputs (the profile would be meaningless).
        ConfigError: a synthetic batch does not fit in host memory.
    """
    if runner.input_kind == "dense":
        lengths = (1,)
    runner.warmup()
    points = tuple(
        _measure_point(runner, size, length, repeats) for length in lengths for size in batch_sizes
    )
    return ServiceProfile(
        points=points,
        model_name=runner.model_name,
        model_version=runner.model_version,
        device=runner.device_name,
        input_kind=runner.input_kind,
        torch_version=torch.__version__,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        device_memory_bytes=runner.device_memory_bytes,
    )


def _measure_point(runner: TorchRunner, size: int, length: int, repeats: int) -> ProfilePoint:
    try:
        decoded = runner.decode(runner.synthetic_items(size, length, seed=size * 1000 + length))
    except MemoryError:  # the synthetic batch itself does not fit in host memory
        raise errors.ConfigError(
            f"profiling batch {size} x length {length} does not fit in this machine's memory; "
            "pass smaller --batch-sizes or --lengths"
        ) from None
    first = runner.forward(decoded)
    if first.failures:
        reason = next(iter(first.failures.values()))
        raise errors.ModelError(f"profiling failed at batch {size} x length {length}: {reason}")
    cuda = runner.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(runner.device)
    seconds = statistics.median(runner.forward(decoded).service_s for _ in range(max(1, repeats)))
    peak = int(torch.cuda.max_memory_allocated(runner.device)) if cuda else None
    logger.info(
        "profile point measured",
        extra={
            "action": "profile_point",
            "batch_size": size,
            "length": length,
            "duration_s": seconds,
        },
    )
    return ProfilePoint(size, length, seconds, peak)


def _pick_device(choice: str) -> torch.device:
    """``cpu``; ``cuda`` (must exist); ``auto`` = cuda when available, else cpu."""
    if choice == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if choice == "cuda":
        raise errors.ConfigError(
            "model.device is cuda but CUDA is not available here; set model.device to auto or cpu"
        )
    return torch.device("cpu")


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


NOT_FINITE = payloads.NOT_FINITE


def _dense_decoded(
    ids: tuple[int, ...], matrix: npt.NDArray[np.float32], failures: dict[int, str], dtype: Any
) -> Decoded:
    """Dense rows as the model's input; a row that is not finite is its item's failure (its
    own input, dead at once with the reason), not a NaN output blamed on the forward pass
    and retried to its last attempt. JSON values were checked as they were read."""
    if not np.isfinite(matrix).all():  # whole: ~7x cheaper than by row, the common case
        finite = np.asarray(np.isfinite(matrix).all(axis=1))
        flags: list[bool] = finite.tolist()
        failures = {
            **failures,
            **{i: NOT_FINITE for i, ok in zip(ids, flags, strict=True) if not ok},
        }
        ids = tuple(i for i, ok in zip(ids, flags, strict=True) if ok)
        matrix = matrix[finite]
    inputs = torch.from_numpy(matrix).to(dtype)
    return Decoded(ids, inputs, None, np.ones(len(ids), dtype=np.int64), failures)


def _collate(seqs: list[IntArray]) -> tuple[torch.Tensor, torch.Tensor, IntArray]:
    """Right-pad with 0: tokens ``[n, L]`` int64, mask ``[n, L]`` (True = pad), lengths."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    width = int(lengths.max()) if len(seqs) else 0
    real = np.arange(width) < lengths[:, None]
    tokens = np.zeros((len(seqs), width), dtype=np.int64)
    if seqs:
        tokens[real] = np.concatenate(seqs)
    return torch.from_numpy(tokens), torch.from_numpy(~real), lengths


@dataclass(frozen=True, slots=True)
class ItemMemory:
    """Device bytes of a forward pass as ``a + rows * (b * length + c * length**2)``
    (attention is quadratic in length; ``a`` is what does not grow with the batch), fitted
    through single-item probes and never below them. ``budget``: the bytes one forward pass
    may use, ``source`` says whence."""

    coefficients: tuple[float, float, float]
    budget: int
    source: str
    max_length: int

    @classmethod
    def fit(
        cls,
        lengths: Sequence[int],
        peaks: Sequence[int],
        budget: int,
        source: str,
        max_length: int,
    ) -> ItemMemory:
        """Fit the curve through ``(length, peak bytes)`` probes (one probe: proportional)."""
        if len(lengths) < 3:
            return cls((0.0, peaks[0] / lengths[0], 0.0), budget, source, max_length)
        c2, c1, c0 = np.polyfit(np.array(lengths, float), np.array(peaks, float), 2).tolist()
        b, c = max(c1, 0.0), max(c2, 0.0)
        # Negative terms would shrink the estimate past the probes: clip them, then raise the
        # fixed part (not the per-row terms: a GPU's workspace, counted in every probe, must
        # not count once per row) until no probe is above the curve.
        a = max(0.0, c0, *(p - b * n - c * n * n for n, p in zip(lengths, peaks, strict=True)))
        return cls((a, b, c), budget, source, max_length)

    def batch(self, rows: int, length: int) -> int:
        """Estimated bytes of a forward pass over ``rows`` items padded to ``length``."""
        a, b, c = self.coefficients
        return math.ceil(a + rows * (b * length + c * length * length))

    def longest(self) -> int:
        """The most tokens one item may have within the budget (``max_length`` at most)."""
        low, high = 0, self.max_length
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.batch(1, mid) <= self.budget else (low, mid - 1)
        return low


class _PeakBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The peak bytes of the tensors the ops return that are alive at once (cpu probes)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self.live:
                    self.live[key] = size
                    self.now += size
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(t, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's CPU threads set to ``threads`` in the block (None: as they are). On CPU a
    pass's reduction order, so its bits, depends on them: a replay of a run of two workers,
    one thread each, needs one."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
