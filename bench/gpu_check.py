"""GPU check: what the scorer does on an NVIDIA GPU, measured in one run, written as one JSON.

Runs the project's own runner (``batching.model.runner``) and micro-batcher
(``batching.policy.batcher``) on W2 with nothing else: torch, numpy and safetensors, plus
orjson (the runner's payload decoder). No database, Prefect, SQLAlchemy or pyarrow, so it
runs on a bare GPU machine (``bench/gpu_check.sh`` sets it up). Checks:

``autocast_bf16``   W2 in float32 and under bf16 autocast: rows/s of each, the largest absolute
                    difference and the lowest cosine between their embeddings.
``pinned_copy``     decoded batches sit in pinned memory; host-to-device GB/s pageable against
                    pinned with ``non_blocking`` copies.
``oom_split``       a real CUDA out-of-memory: the GPU filled but for a little headroom, one
                    batch too big for it; the runner splits it, every item still gets its
                    output, equal to the unsplit reference's (max abs difference).
``w2_dynamic``      W2 requests one at a time against dynamic batches (the shipped bulk
                    policy: length buckets, batches of 32 or 4,096 tokens), decode of the next
                    batch overlapping the forward pass as in the scorer; rows/s and the ratio.
``gpu_busy``        GPU utilisation (NVML, sampled every 50 ms) during a W2 bulk run.

    bench/gpu_check.sh                      # on the GPU machine; writes $OUT or ./gpu_check.json
    python bench/gpu_check.py --smoke       # on a CPU: small sizes, the CUDA parts skipped

Targets (issue "Scale past one host"): W2 dynamic >= 20x batch-1, GPU busy >= 90% in the bulk run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batching import models
from batching.model import workloads, zoo
from batching.model.runner import TorchRunner
from batching.policy.batcher import MicroBatcher

W2 = zoo.BUILTINS["w2-text"]


@dataclass(frozen=True)
class Spec:
    """The fields of ``batching.config.ModelSpec`` the runner reads, with its defaults (the
    GPU machine has no pydantic to build the real one)."""

    name: str = W2.name
    version: str = "w2-text-v1"
    checkpoint: str | None = None
    sha256: str = W2.sha256
    dtype: str = "float32"
    device: str = "auto"
    autocast: str = "none"
    max_item_tokens: int = 16384
    max_item_elements: int = 1_048_576
    max_item_bytes: int = 16 * 2**20
    memory_budget_bytes: int | None = None


@dataclass(frozen=True)
class Policy:
    """``deployments/bulk.yaml``'s batching policy, as the batcher reads it."""

    max_batch_size: int = 32
    max_batch_cost: int | None = 4096
    max_wait_s: float = 2.0
    length_buckets: tuple[int, ...] = (16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120)


def _load(spec: Spec) -> TorchRunner:
    return TorchRunner.load(spec)  # type: ignore[arg-type]  # Spec stands in for ModelSpec


def w2_items(n: int, start: int = 0) -> list[models.WorkItem]:
    """``n`` W2 requests as claimed items: int64 token tensors, cost = length."""
    return [
        models.WorkItem(
            id=start + i,
            item_key=f"w2-{start + i}",
            payload=models.Payload(
                seq.tobytes(), models.PayloadFormat.TENSOR, "int64", (len(seq),)
            ),
            enqueued_at=0.0,
            cost=len(seq),
        )
        for i, seq in enumerate(workloads.w2_inputs(n))
    ]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _embeddings(runner: TorchRunner, items: Sequence[models.WorkItem]) -> dict[int, np.ndarray]:
    result = runner.score(items)
    if result.failures:
        raise RuntimeError(
            f"{len(result.failures)} items failed: {next(iter(result.failures.values()))}"
        )
    return {i: np.asarray(result.outputs[i], dtype=np.float32) for i in result.outputs}


def _batches(items: Sequence[models.WorkItem]) -> list[models.Batch]:
    """``items`` cut by the bulk policy, as a drained scorer cuts them."""
    batcher = MicroBatcher(Policy(), clock=time.time)  # type: ignore[arg-type]
    batcher.add(items)
    return batcher.drain()


def run_batches(runner: TorchRunner, batches: Sequence[models.Batch]) -> tuple[float, int]:
    """Score ``batches`` with the next one's decode overlapping this one's forward (the
    scorer's decode thread); (seconds, rows with an output)."""
    done = 0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        _sync()
        started = time.perf_counter()
        pending = pool.submit(runner.decode, batches[0].items) if batches else None
        for k in range(len(batches)):
            assert pending is not None
            decoded = pending.result()
            if k + 1 < len(batches):
                pending = pool.submit(runner.decode, batches[k + 1].items)
            done += len(runner.forward(decoded).outputs)
        _sync()
    return time.perf_counter() - started, done


def check_autocast(n: int) -> dict[str, Any]:
    items = w2_items(n)
    out: dict[str, Any] = {}
    results = {}
    for mode in ("none", "bf16"):
        runner = _load(Spec(autocast=mode))
        runner.warmup()
        batches = _batches(items)
        seconds, rows = run_batches(runner, batches)
        out[f"rows_s_{'fp32' if mode == 'none' else 'bf16'}"] = round(rows / seconds, 1)
        results[mode] = _embeddings(runner, items)
        del runner
    a = np.stack([results["none"][i] for i in sorted(results["none"])])
    b = np.stack([results["bf16"][i] for i in sorted(results["bf16"])])
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    out["max_abs_diff"] = float(np.abs(a - b).max())
    out["min_cosine"] = float(cos.min())
    out["autocast_active"] = torch.cuda.is_available()
    return out


def check_pinned(size_mb: int = 256) -> dict[str, Any]:
    runner = _load(Spec())
    decoded = runner.decode(w2_items(64))
    out: dict[str, Any] = {"decoded_inputs_pinned": bool(decoded.inputs.is_pinned())}
    if not torch.cuda.is_available():
        return out | {"skipped": "no CUDA device"}
    host = torch.empty(size_mb * 2**20, dtype=torch.uint8)
    pinned = host.pin_memory()
    for name, src, blocking in (("pageable", host, True), ("pinned_non_blocking", pinned, False)):
        src.to("cuda", non_blocking=not blocking)  # first copy: allocator, driver
        _sync()
        started = time.perf_counter()
        for _ in range(5):
            src.to("cuda", non_blocking=not blocking)
        _sync()
        out[f"gb_s_{name}"] = round(5 * size_mb / 1024 / (time.perf_counter() - started), 2)
    return out


def check_oom_split(n: int, headroom_gib: float) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    # memory_budget_bytes past any GPU: the runner's estimate must not split first; the
    # allocator has to fail for real.
    runner = _load(Spec(memory_budget_bytes=2**50))
    items = [i._replace(cost=128) for i in w2_items(n)]
    reference = {}
    for k in range(0, n, 64):
        reference.update(_embeddings(runner, items[k : k + 64]))
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    filler = torch.empty(max(0, free - int(headroom_gib * 2**30)), dtype=torch.uint8, device="cuda")
    try:
        started = time.perf_counter()
        result = runner.score(items)
        seconds = time.perf_counter() - started
    finally:
        del filler
        torch.cuda.empty_cache()
    got = {i: np.asarray(result.outputs[i], dtype=np.float32) for i in result.outputs}
    diff = max(float(np.abs(got[i] - reference[i]).max()) for i in got) if got else None
    return {
        "items": n,
        "headroom_gib": headroom_gib,
        "gpu_total_gib": round(total / 2**30, 1),
        "oom_splits": result.n_oom_splits,
        "oom_ceiling": runner.oom_ceiling,
        "outputs": len(got),
        "failures": len(result.failures),
        "max_abs_diff_vs_unsplit": diff,
        "seconds": round(seconds, 3),
        "ok": result.n_oom_splits > 0 and len(got) == n,
    }


def check_dynamic(n: int, n_batch1: int) -> dict[str, Any]:
    runner = _load(Spec())
    runner.warmup()
    items = w2_items(n)
    one = items[:n_batch1]
    _sync()
    started = time.perf_counter()
    for item in one:
        runner.forward(runner.decode([item]))
    _sync()
    batch1 = n_batch1 / (time.perf_counter() - started)
    batches = _batches(items)
    seconds, rows = run_batches(runner, batches)
    dynamic = rows / seconds
    return {
        "items": n,
        "batch1_items": n_batch1,
        "batch1_rows_s": round(batch1, 1),
        "dynamic_rows_s": round(dynamic, 1),
        "dynamic_vs_batch1": round(dynamic / batch1, 2),
        "batches": len(batches),
        "mean_batch": round(n / max(len(batches), 1), 1),
    }


class Nvml:
    """GPU utilisation from NVML through ctypes (no pynvml on a bare machine)."""

    class _Util(ctypes.Structure):
        _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]

    def __init__(self) -> None:
        self._lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self._lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit failed")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        self._handle = ctypes.c_void_p()
        index = int(visible) if visible.isdigit() else 0
        if self._lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self._handle)) != 0:
            raise OSError(f"NVML has no device {index}")

    def busy_percent(self) -> int:
        util = self._Util()
        if self._lib.nvmlDeviceGetUtilizationRates(self._handle, ctypes.byref(util)) != 0:
            raise OSError("nvmlDeviceGetUtilizationRates failed")
        return int(util.gpu)


def sampled(
    read: Callable[[], int], work: Callable[[], Any], every_s: float
) -> tuple[Any, list[int]]:
    """Run ``work`` while ``read`` is sampled every ``every_s``; (its result, the samples)."""
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(every_s):
            samples.append(read())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = work()
    finally:
        stop.set()
        thread.join()
    return result, samples


def check_busy(n: int) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    try:
        nvml = Nvml()
    except OSError as exc:
        return {"skipped": f"NVML unavailable: {exc}"}
    runner = _load(Spec())
    runner.warmup()
    batches = _batches(w2_items(n))
    (seconds, rows), samples = sampled(
        nvml.busy_percent, lambda: run_batches(runner, batches), 0.05
    )
    steady = samples[2:-2] or samples  # the first and last samples straddle the start and end
    return {
        "items": n,
        "rows_s": round(rows / seconds, 1),
        "samples": len(samples),
        "busy_mean_percent": round(sum(steady) / max(len(steady), 1), 1),
        "busy_min_percent": min(steady) if steady else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--smoke", action="store_true", help="small sizes (a CPU run)")
    parser.add_argument("--oom-headroom-gib", type=float, default=2.0)
    args = parser.parse_args()
    scale = 1 if not args.smoke else 0
    sizes = {
        "autocast": 2048 if scale else 64,
        "oom": 8192 if scale else 64,
        "dynamic": 6000 if scale else 96,
        "batch1": 600 if scale else 24,
        "busy": 30000 if scale else 96,
    }
    report: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "smoke": args.smoke,
        "sizes": sizes,
    }
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "autocast_bf16": lambda: check_autocast(sizes["autocast"]),
        "pinned_copy": check_pinned,
        "oom_split": lambda: check_oom_split(sizes["oom"], args.oom_headroom_gib),
        "w2_dynamic": lambda: check_dynamic(sizes["dynamic"], sizes["batch1"]),
        "gpu_busy": lambda: check_busy(sizes["busy"]),
    }
    for name, check in checks.items():
        started = time.perf_counter()
        try:
            report[name] = check()
        except Exception as exc:  # one failed check must not lose the others' figures
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[name]["check_s"] = round(time.perf_counter() - started, 2)
        print(name, json.dumps(report[name]), flush=True)
        args.out.write_text(json.dumps(report, indent=2))  # after each: a killed run keeps some
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
