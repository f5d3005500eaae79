"""TorchRunner with the real built-in models, real checkpoint files and real torch."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from batching import errors, models
from batching.config import ModelSpec
from batching.model import payloads, runner, zoo
from batching.plan.profile import ServiceProfile

POISON = 999.0
NAN_MARK = -777.0
OOM_ABOVE = 16
EXPLOITED = Path("/tmp/batching-test-runner-exploited")


# ---- test models (plugged in through factories named after this module) -------------------


class ProbeModel(nn.Module):
    """Dense, 4 inputs -> 1 output; raises on POISON, returns NaN on NAN_MARK (column 0)."""

    batching_input = "dense"
    batching_input_dim = 4

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(int(x.shape[0]))
        if bool((x[:, 0] == POISON).any()):
            raise ValueError("poison marker seen")
        y = (x * self.scale).sum(dim=1, keepdim=True)
        return torch.where(x[:, :1] == NAN_MARK, torch.nan, y)


class ShortModel(ProbeModel):
    """Breaks the contract: drops the last output of any batch larger than one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y[:-1] if len(y) > 1 else y


class OomModel(ProbeModel):
    """Raises CUDA out-of-memory (on CPU too) for batches larger than OOM_ABOVE."""

    def __init__(self) -> None:
        super().__init__()
        self.n_oom = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > OOM_ABOVE:
            self.n_oom += 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(x)


def build_probe() -> nn.Module:
    return ProbeModel()


def build_short() -> nn.Module:
    return ShortModel()


def build_oom() -> nn.Module:
    return OomModel()


def _mark_exploited() -> None:  # pragma: no cover - must never run
    EXPLOITED.write_text("unpickling ran code")


class Evil:
    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_mark_exploited, ())


# ---- helpers and fixtures ---------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def builtin_spec(name: str, **overrides: object) -> ModelSpec:
    fields: dict[str, object] = {
        "name": name,
        "version": "v1",
        "sha256": zoo.BUILTINS[name].sha256,
        "device": "cpu",
    }
    return ModelSpec.model_validate({**fields, **overrides})


def item(item_id: int, payload: models.Payload) -> models.WorkItem:
    return models.WorkItem(id=item_id, item_key=f"k{item_id}", payload=payload, enqueued_at=0.0)


def json_item(item_id: int, doc: object) -> models.WorkItem:
    return item(item_id, models.Payload(json.dumps(doc).encode()))


def tensor_item(item_id: int, arr: np.ndarray, dtype: str | None = None) -> models.WorkItem:
    payload = models.Payload(
        arr.tobytes(), models.PayloadFormat.TENSOR, dtype or str(arr.dtype), arr.shape
    )
    return item(item_id, payload)


def dense_items(rows: np.ndarray, start: int = 0) -> list[models.WorkItem]:
    return [json_item(start + i, {"x": row.tolist()}) for i, row in enumerate(rows)]


@pytest.fixture(scope="module")
def w1() -> runner.TorchRunner:
    return runner.TorchRunner.load(builtin_spec("w1-mlp"))


@pytest.fixture(scope="module")
def w2() -> runner.TorchRunner:
    return runner.TorchRunner.load(builtin_spec("w2-text"))


@pytest.fixture(scope="module")
def probe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("ckpt") / "probe.safetensors"
    save_file({"scale": torch.ones(4)}, str(path))
    return path, sha256_of(path)


def probe_runner(factory: str, ckpt: tuple[Path, str]) -> runner.TorchRunner:
    spec = ModelSpec(
        name=f"{__name__}:{factory}",
        version="t1",
        checkpoint=str(ckpt[0]),
        sha256=ckpt[1],
        device="cpu",
    )
    return runner.TorchRunner.load(spec)


def reference(name: str) -> nn.Module:
    model = zoo.BUILTINS[name].factory()
    model.load_state_dict(load_file(str(zoo.BUILTINS[name].checkpoint_path)))
    return model.eval()


def token_lists(lengths: Sequence[int], seed: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, zoo.W2_VOCAB_SIZE, size=n, dtype=np.int64) for n in lengths]


# ---- checkpoints ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(zoo.BUILTINS))
def test_shipped_checkpoints_match_their_pinned_digest(name: str) -> None:
    assert sha256_of(zoo.BUILTINS[name].checkpoint_path) == zoo.BUILTINS[name].sha256


def test_sha256_mismatch_is_refused_with_both_digests() -> None:
    wrong = "0" * 64
    with pytest.raises(errors.CheckpointError) as info:
        runner.TorchRunner.load(builtin_spec("w1-mlp", sha256=wrong))
    message = str(info.value)
    assert "w1_mlp_v1.safetensors" in message
    assert wrong in message
    assert zoo.BUILTINS["w1-mlp"].sha256 in message
    assert "model.sha256" in message


def test_missing_checkpoint_is_refused(tmp_path: Path) -> None:
    spec = builtin_spec("w1-mlp", checkpoint="nope.safetensors")
    with pytest.raises(errors.CheckpointError, match="cannot be read"):
        runner.TorchRunner.load(spec, base_dir=tmp_path)


@pytest.mark.parametrize(
    "payload",
    [pytest.param(lambda: ProbeModel(), id="pickled-module"), pytest.param(Evil, id="reduce")],
)
def test_checkpoint_needing_unpickling_is_refused_without_running_code(
    tmp_path: Path, payload: Callable[[], object]
) -> None:
    EXPLOITED.unlink(missing_ok=True)
    path = tmp_path / "model.pt"
    torch.save({"model": payload()}, path)
    with pytest.raises(errors.CheckpointError, match="arbitrary unpickling"):
        probe_runner("build_probe", (path, sha256_of(path)))
    assert not EXPLOITED.exists()


def test_a_plain_pickle_of_protocol_4_is_refused_in_one_line(tmp_path: Path) -> None:
    """torch warned first ("Detected pickle protocol 4"): two lines before the refusal."""
    EXPLOITED.unlink(missing_ok=True)
    path = tmp_path / "model.pt"
    with path.open("wb") as f:
        pickle.dump({"model": Evil()}, f, protocol=4)
    with pytest.raises(errors.CheckpointError, match=r"model\.pt is not a readable torch"):
        probe_runner("build_probe", (path, sha256_of(path)))  # a warning would fail it here
    assert not EXPLOITED.exists()


@pytest.mark.parametrize("data", [b"\x80\x02garbage", bytes(range(256)) * 2, b"PK\x03\x04junk"])
def test_a_damaged_pt_file_is_called_unreadable_not_unsafe(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(data)
    with pytest.raises(errors.CheckpointError) as caught:
        probe_runner("build_probe", (path, sha256_of(path)))
    assert "arbitrary unpickling" not in str(caught.value)
    assert "not a readable torch state dict" in str(caught.value) or "cannot be read" in str(
        caught.value
    )


def test_plain_state_dict_pt_loads_with_weights_only(tmp_path: Path) -> None:
    path = tmp_path / "probe.pt"
    torch.save({"scale": torch.full((4,), 2.0)}, path)
    r = probe_runner("build_probe", (path, sha256_of(path)))
    out = r.score([json_item(1, {"x": [1, 1, 1, 1]})]).outputs[1]
    np.testing.assert_array_equal(out, np.array([8.0], dtype=np.float32))


def test_checkpoint_that_does_not_fit_the_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.safetensors"
    save_file({"weight": torch.ones(3)}, str(path))
    with pytest.raises(errors.CheckpointError, match="does not fit the model"):
        probe_runner("build_probe", (path, sha256_of(path)))


def test_unsupported_checkpoint_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.pkl"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(errors.CheckpointError, match="unsupported format"):
        probe_runner("build_probe", (path, sha256_of(path)))


def test_unknown_model_name_and_bad_factory_are_config_errors(probe_ckpt: tuple[Path, str]) -> None:
    with pytest.raises(errors.ConfigError, match="not built in"):
        runner.TorchRunner.load(builtin_spec("w1-mlp").model_copy(update={"name": "w9"}))
    with pytest.raises(errors.ConfigError, match="cannot be imported"):
        probe_runner("no_such_factory", probe_ckpt)


def test_a_factory_module_that_fails_on_import_is_one_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probe_ckpt: tuple[Path, str]
) -> None:
    (tmp_path / "broken_models.py").write_text("raise RuntimeError('needs a GPU driver')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = builtin_spec("w1-mlp").model_copy(
        update={
            "name": "broken_models:build",
            "checkpoint": str(probe_ckpt[0]),
            "sha256": probe_ckpt[1],
        }
    )
    with pytest.raises(errors.ConfigError, match=r"cannot be imported \(RuntimeError: needs a"):
        runner.TorchRunner.load(spec)


# ---- outputs equal the model run directly ------------------------------------------------------


def test_w1_outputs_equal_the_model_run_directly(w1: runner.TorchRunner) -> None:
    rows = np.random.default_rng(1).standard_normal((50, 64), dtype=np.float32)
    result = w1.score(dense_items(rows))
    with torch.no_grad():
        expected = reference("w1-mlp")(torch.from_numpy(rows)).numpy()
    assert not result.failures
    got = np.stack([result.outputs[i] for i in range(50)])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert (w1.output_dim, w1.input_kind, w1.input_dim) == (1, "dense", 64)
    assert (w1.model_version, w1.checksum, w1.device.type) == (
        "v1",
        zoo.BUILTINS["w1-mlp"].sha256,
        "cpu",
    )


def test_w2_batched_outputs_equal_each_item_alone(w2: runner.TorchRunner) -> None:
    seqs = token_lists([5, 40, 12, 40, 8])
    result = w2.score([json_item(i, {"tokens": s.tolist()}) for i, s in enumerate(seqs)])
    model = reference("w2-text")
    assert not result.failures
    assert (result.real_tokens, result.padded_tokens) == (105, 200)
    for i, seq in enumerate(seqs):
        tokens = torch.from_numpy(seq)[None, :]
        with torch.no_grad():
            alone = model(tokens, torch.zeros_like(tokens, dtype=torch.bool))[0].numpy()
        assert result.outputs[i].shape == (256,)
        np.testing.assert_allclose(result.outputs[i], alone, rtol=1e-4, atol=1e-4)


def test_json_and_tensor_payloads_give_identical_outputs(
    w1: runner.TorchRunner, w2: runner.TorchRunner
) -> None:
    rows = np.random.default_rng(3).standard_normal((6, 64), dtype=np.float32)
    dense_json = w1.score(dense_items(rows)).outputs
    dense_tensor = w1.score([tensor_item(i, r) for i, r in enumerate(rows)]).outputs
    seqs = token_lists([9, 17, 3])
    tok_json = w2.score([json_item(i, {"tokens": s.tolist()}) for i, s in enumerate(seqs)]).outputs
    tok_tensor = w2.score([tensor_item(i, s.astype(np.int32)) for i, s in enumerate(seqs)]).outputs
    for i in range(6):
        np.testing.assert_array_equal(dense_json[i], dense_tensor[i])
    for i in range(3):
        np.testing.assert_array_equal(tok_json[i], tok_tensor[i])


# ---- failure isolation ------------------------------------------------------------------------


def test_dense_decode_failures_fail_alone(w1: runner.TorchRunner) -> None:
    good = np.random.default_rng(4).standard_normal((2, 64), dtype=np.float32)
    bad = [
        item(10, models.Payload(b"{not json")),
        json_item(11, {"y": [0.0] * 64}),
        json_item(12, {"x": [0.0] * 63}),
        json_item(13, {"x": ["a"] * 64}),
        tensor_item(14, good[0], dtype="bfloat16"),
        tensor_item(15, good[0][:63]),
        tensor_item(16, good[0].astype(np.bool_)),
        item(17, models.Payload(good[0].tobytes(), models.PayloadFormat.TENSOR)),
    ]
    result = w1.score([*dense_items(good), *bad])
    assert set(result.outputs) == {0, 1}
    assert set(result.failures) == {10, 11, 12, 13, 14, 15, 16, 17}
    assert all("\n" not in reason for reason in result.failures.values())
    alone = w1.score(dense_items(good[1:], start=1)).outputs[1]
    np.testing.assert_allclose(result.outputs[1], alone, rtol=1e-6)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e300])
def test_a_tensor_that_is_not_finite_fails_alone_at_decode_as_its_own_input(
    w1: runner.TorchRunner, bad: float
) -> None:
    """NaN, inf or a float64 past float32 in a tensor payload is the item's own input: it
    fails at decode (dead at once, with that reason), not as a NaN output blamed on the
    forward and retried to its last attempt; its batch-mates score as without it."""
    rows = np.random.default_rng(6).standard_normal((4, 64)).astype(np.float64)
    rows[2, 7] = bad
    one_header = [tensor_item(i, r) for i, r in enumerate(rows)]
    block = models.ItemBlock(
        one_header[0],
        [i.id for i in one_header],
        [i.item_key for i in one_header],
        [0.0] * 4,
        [1] * 4,
        [5] * 4,
        b"".join(i.payload.data for i in one_header),
    )
    batch: Sequence[models.WorkItem]
    for batch in (one_header, block):
        result = w1.score(batch)
        assert set(result.outputs) == {0, 1, 3}
        assert result.failures == {2: runner.NOT_FINITE}
    mixed = w1.score([*one_header, tensor_item(9, rows[0].astype(np.float32))])
    assert mixed.failures == {2: runner.NOT_FINITE}


def test_a_tensor_batch_of_one_header_decodes_whole_and_a_bad_length_fails_alone(
    w1: runner.TorchRunner,
) -> None:
    """Tensors of one dtype and shape decode as one block (no step per item); a payload of that
    header but the wrong byte length, or a batch mixing dtypes, takes the item-by-item path."""
    rows = np.random.default_rng(5).standard_normal((5, 64), dtype=np.float32)
    whole = w1.score([tensor_item(i, r) for i, r in enumerate(rows)]).outputs
    direct = reference("w1-mlp")(torch.from_numpy(rows)).detach().numpy()
    np.testing.assert_allclose(np.stack([whole[i] for i in range(5)]), direct, rtol=1e-5)
    short = item(
        9, models.Payload(rows[0].tobytes()[:-4], models.PayloadFormat.TENSOR, "float32", (64,))
    )
    wide = tensor_item(8, rows[1].astype(np.float64))
    result = w1.score([*(tensor_item(i, r) for i, r in enumerate(rows)), short, wide])
    assert set(result.outputs) == {0, 1, 2, 3, 4, 8}
    assert result.failures[9] == "tensor has 252 bytes, expected 256 (float32, shape (64,))"
    np.testing.assert_allclose(result.outputs[8], whole[1], rtol=1e-5)


def test_token_decode_failures_fail_alone(w2: runner.TorchRunner) -> None:
    seq = token_lists([6])[0]
    bad = [
        json_item(10, {"tokens": [0, 5, 7]}),
        json_item(11, {"tokens": [5, zoo.W2_VOCAB_SIZE]}),
        json_item(12, {"tokens": [-3]}),
        json_item(13, {"tokens": []}),
        json_item(14, {"tokens": [1.5, 2]}),
        json_item(15, {"tokens": [[1, 2], [3]]}),
        tensor_item(16, seq.astype(np.float32)),
        json_item(17, {"tokens": "abc"}),
    ]
    result = w2.score([json_item(0, {"tokens": seq.tolist()}), *bad])
    assert set(result.outputs) == {0}
    assert set(result.failures) == set(range(10, 18))
    assert "[1, 30000)" in result.failures[11]


def test_the_doors_fit_check_says_what_decode_says(
    w1: runner.TorchRunner, w2: runner.TorchRunner
) -> None:
    """``payloads.fit_error`` (the HTTP ingress's 422) refuses exactly the payloads the model's
    decode fails, with the same words, from a model built without its weights."""
    good = np.random.default_rng(4).standard_normal((1, 64), dtype=np.float32)[0]
    dense = [
        json_item(0, {"x": good.tolist()}),
        tensor_item(1, good),
        tensor_item(2, good.astype(np.float64)),
        item(10, models.Payload(b"{not json")),
        json_item(11, {"y": [0.0] * 64}),
        json_item(12, {"x": [0.0] * 63}),
        json_item(13, {"x": ["a"] * 64}),
        json_item(14, [0.0] * 64),
        tensor_item(15, good, dtype="bfloat16"),
        tensor_item(16, good[:63]),
        tensor_item(17, good.astype(np.bool_)),
        tensor_item(18, np.where(np.arange(64) == 3, np.inf, good)),
        item(19, models.Payload(good.tobytes(), models.PayloadFormat.TENSOR)),
    ]
    seq = token_lists([6])[0]
    tokens = [
        json_item(0, {"tokens": seq.tolist()}),
        tensor_item(1, seq.astype(np.int32)),
        json_item(10, {"tokens": [0, 5, 7]}),
        json_item(11, {"tokens": [5, zoo.W2_VOCAB_SIZE]}),
        json_item(12, {"tokens": []}),
        json_item(13, {"tokens": [1.5, 2]}),
        json_item(14, {"tokens": [[1, 2], [3]]}),
        tensor_item(15, seq.astype(np.float32)),
        json_item(16, {"tokens": "abc"}),
        json_item(17, {"x": [1]}),
    ]
    for loaded, items in ((w1, dense), (w2, tokens)):
        info = zoo.describe_unloaded(loaded.model_name)
        assert (info.input_kind, info.input_dim, info.vocab_size) == (
            loaded.input_kind,
            loaded.input_dim,
            loaded.vocab_size,
        )
        decoded = {i.id: loaded.decode([i]).failures.get(i.id) for i in items}
        at_door = {
            i.id: payloads.fit_error(i.payload, info.input_kind, info.input_dim, info.vocab_size)
            for i in items
        }
        assert at_door == decoded
        assert {i for i, why in at_door.items() if why is None} == {0, 1, 2} & set(at_door)


def test_poison_item_fails_alone_and_batch_mates_score(probe_ckpt: tuple[Path, str]) -> None:
    r = probe_runner("build_probe", probe_ckpt)
    rows = np.ones((8, 4), dtype=np.float32)
    rows[5, 0] = POISON
    rows[2, 0] = NAN_MARK
    result = r.score(dense_items(rows))
    assert set(result.failures) == {2, 5}
    assert "poison marker seen" in result.failures[5]
    assert "not finite" in result.failures[2]
    assert {i: float(v[0]) for i, v in result.outputs.items()} == dict.fromkeys(
        [0, 1, 3, 4, 6, 7], 4.0
    )
    assert result.batch_error is None
    assert result.whole_batch_error is None  # one poison: no sign of a broken model
    assert result.poisoned == {5}  # counted as poison isolated (the NaN is not: no bisection)
    assert result.n_oom_splits == 0


@pytest.mark.parametrize(
    ("n_rows", "factory", "whole"),
    [
        (8, "build_probe", "ValueError: poison marker seen"),  # bisected to every item alone
        (1, "build_probe", None),  # one item: poison or model, no telling
        (4, "build_short", "model returned 3 outputs for 4 inputs"),  # a broken contract
    ],
)
def test_a_batch_failing_as_a_whole_is_reported_for_the_breaker(
    probe_ckpt: tuple[Path, str], n_rows: int, factory: str, whole: str | None
) -> None:
    r = probe_runner(factory, probe_ckpt)
    rows = np.ones((n_rows, 4), dtype=np.float32)
    if factory == "build_probe":
        rows[:, 0] = POISON
    result = r.score(dense_items(rows))
    assert set(result.failures) == set(range(n_rows))
    assert (whole is None) == (result.whole_batch_error is None)
    assert whole is None or whole in str(result.whole_batch_error)
    if factory == "build_probe":
        assert result.n_forward == 2 * n_rows - 1  # what a storm costs per batch


def test_nan_output_marks_only_that_item(probe_ckpt: tuple[Path, str]) -> None:
    r = probe_runner("build_probe", probe_ckpt)
    model = r.model
    assert isinstance(model, ProbeModel)
    assert model.calls == [1]  # the output width was probed at load (not declared)
    assert r.output_dim == 1
    rows = np.ones((4, 4), dtype=np.float32)
    rows[1, 0] = NAN_MARK
    result = r.score(dense_items(rows))
    assert set(result.failures) == {1}
    assert set(result.outputs) == {0, 2, 3}
    assert model.calls == [1, 4, 1]  # no bisection for a NaN: its row again, alone


def test_wrong_output_count_fails_the_batch_with_model_error(
    probe_ckpt: tuple[Path, str],
) -> None:
    r = probe_runner("build_short", probe_ckpt)
    result = r.score(dense_items(np.ones((5, 4), dtype=np.float32)))
    assert not result.outputs
    assert set(result.failures) == set(range(5))
    assert result.batch_error is not None
    assert "4 outputs for 5 inputs" in result.batch_error


def test_oom_splits_the_batch_and_remembers_the_safe_size(probe_ckpt: tuple[Path, str]) -> None:
    r = probe_runner("build_oom", probe_ckpt)
    model = r.model
    assert isinstance(model, OomModel)
    first = r.score(dense_items(np.ones((64, 4), dtype=np.float32)))
    assert len(first.outputs) == 64
    assert not first.failures
    assert r.oom_ceiling == OOM_ABOVE
    assert first.n_oom_splits == model.n_oom > 0  # each OOM split the sub-batch once
    assert not first.poisoned
    n_oom, model.calls = model.n_oom, []
    second = r.score(dense_items(np.ones((40, 4), dtype=np.float32)))
    assert len(second.outputs) == 40
    assert model.n_oom == n_oom
    assert model.calls == [16, 16, 8]


def test_autocast_is_ignored_on_cpu(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="batching.model.runner"):
        r = runner.TorchRunner.load(builtin_spec("w1-mlp", autocast="bf16"))
    assert any(getattr(rec, "action", "") == "autocast_ignored" for rec in caplog.records)
    assert r.score(dense_items(np.zeros((2, 64), dtype=np.float32))).outputs[0].dtype == np.float32


# ---- profile ---------------------------------------------------------------------------------


def test_measure_profile_round_trips(
    w1: runner.TorchRunner, w2: runner.TorchRunner, tmp_path: Path
) -> None:
    dense = runner.measure_profile(w1, batch_sizes=(1, 8), repeats=2)
    assert {(p.batch_size, p.length) for p in dense.points} == {(1, 1), (8, 1)}
    assert dense.model_name == "w1-mlp"
    assert dense.predict(8) >= dense.predict(1) > 0
    text = runner.measure_profile(w2, batch_sizes=(1, 2), lengths=(8, 16), repeats=1)
    assert len(text.points) == 4
    assert text.input_kind == "tokens"
    loaded = ServiceProfile.load(text.save(tmp_path / "profile.json"))
    assert loaded.points == text.points
    assert loaded.predict(2, 16) == text.predict(2, 16)


def test_empty_and_all_failed_batches_score_nothing(w1: runner.TorchRunner) -> None:
    empty = w1.score([])
    assert (empty.outputs, empty.failures, empty.n_forward) == ({}, {}, 0)
    failed = w1.score([item(1, models.Payload(b"[]")), item(2, models.Payload(b"\xff"))])
    assert set(failed.failures) == {1, 2}
    assert (failed.outputs, failed.n_forward, failed.padded_tokens) == ({}, 0, 0)


def test_a_profile_point_too_big_for_memory_is_a_config_error(
    w1: runner.TorchRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = w1.synthetic_items

    def no_memory(n_items: int, length: int = 16, seed: int = 0) -> tuple[models.WorkItem, ...]:
        if n_items > 1000:
            raise MemoryError  # what numpy raises for a batch larger than the machine
        return real(n_items, length, seed)

    monkeypatch.setattr(w1, "synthetic_items", no_memory)
    with pytest.raises(errors.ConfigError, match="batch 4096 x length 1 does not fit"):
        runner.measure_profile(w1, batch_sizes=(4096,), repeats=1)
