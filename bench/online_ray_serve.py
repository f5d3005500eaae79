"""Ray Serve's W2 deployment behind its own HTTP proxy, for `bench/online_bench.py`. Not a test.

Runs in the peers' Ray venv (`$PEERS/venv-ray/bin/python`), never in the project's. The
deployment is the peers' harness's (`$PEERS/bench_ray_serve.py`: `@serve.batch` over
`workloads.pad_batch` + the W2 encoder, `max_ongoing_requests` 256, `num_cpus` 0), with an HTTP
``__call__`` in place of the handle call, so that the open-loop generator reaches it the way a
client of Ray Serve would: POST http://127.0.0.1:PORT/w2 {"tokens": [...]} -> {"y": [...]}.
Ray Serve's default overload behaviour is kept (requests queue at the proxy; nothing is shed).

    $PEERS/venv-ray/bin/python bench/online_ray_serve.py --peers $PEERS --port 18200
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--peers", required=True, help="the peers' folder (its workloads.py)")
parser.add_argument("--port", type=int, default=18200)
parser.add_argument("--max-batch", type=int, default=32)
parser.add_argument("--wait-s", type=float, default=0.01)
args = parser.parse_args()
sys.path.insert(0, args.peers)

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402


@serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 0})
class Scorer:
    def __init__(self) -> None:
        import torch
        import workloads as W

        W.setup_torch()
        self.torch, self.W = torch, W
        self.m = W.build_w2()

    @serve.batch(max_batch_size=args.max_batch, batch_wait_timeout_s=args.wait_s)  # type: ignore[untyped-decorator]
    async def score(self, items: list[Any]) -> list[Any]:
        with self.torch.inference_mode():
            tok, lens, _, _ = self.W.pad_batch(items)
            out = self.m(tok, lens).numpy()
        return [out[i] for i in range(len(items))]

    async def __call__(self, request: Any) -> dict[str, Any]:
        body = await request.json()
        emb = await self.score(np.asarray(body["tokens"], dtype=np.int64))
        return {"y": emb.tolist()}


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(Scorer.bind(), name="w2", route_prefix="/w2")  # type: ignore[attr-defined]
    print("RAY_SERVE_READY", flush=True)
    stop = False

    def on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while not stop:
        time.sleep(0.2)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
