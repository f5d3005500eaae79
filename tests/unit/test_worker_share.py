"""``score --workers N`` gives each worker a claim of its share: one worker claiming the
shipped claim_size took a whole backlog as one range lease while the others ended idle."""

from __future__ import annotations

from batching import config
from batching.compose.run import claiming_a_share

SHA = "0" * 64


def pipeline(**batching: object) -> config.PipelineConfig:
    return config.parse_config(
        {"model": {"name": "w1-mlp", "version": "v1", "sha256": SHA}, "batching": batching}
    )


def test_each_worker_claims_its_share_never_under_a_batch() -> None:
    shipped = pipeline(max_batch_size=32, claim_size=3000)  # bulk.yaml's shape
    assert claiming_a_share(shipped, 2).batching.effective_claim_size == 1500
    assert claiming_a_share(shipped, 200).batching.effective_claim_size == 32
    assert claiming_a_share(shipped, 1) is shipped
    unset = pipeline(max_batch_size=64)  # four batches' worth: 256
    assert claiming_a_share(unset, 4).batching.effective_claim_size == 64
    assert claiming_a_share(unset, 4).batching.max_batch_size == 64
