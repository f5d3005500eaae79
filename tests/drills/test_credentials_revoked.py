"""Drill: the scorer's credentials are revoked mid-run (``ALTER ROLE ... NOLOGIN`` and its
sessions terminated, as an operator rotating a leaked password does).

The run fails fast (not minutes of retries against a server that will keep saying no) with one
line naming the credential problem and a non-zero exit; the leases it held expire; once the
login is granted back a new run commits every item exactly once.
"""

from __future__ import annotations

import json
import time

from tests.drills.conftest import Drill, assert_nothing_lost, finish, report
from tests.integration.test_pipeline import wait_for_done

N = 2000
LEASE_S = 3.0


def test_credentials_revoked_mid_run_fail_fast_and_lose_nothing(drill: Drill) -> None:
    drill.queue(N, queue={"lease_s": LEASE_S})
    proc = drill.start_score("--json")
    wait_for_done(drill.url, 200, proc)

    drill.cluster.sql(f"ALTER ROLE {drill.role} NOLOGIN")
    revoked_at = time.monotonic()
    terminated = drill.cluster.terminate(role=drill.role)
    failed = finish(proc, timeout_s=120)
    took_s = time.monotonic() - revoked_at
    assert terminated >= 1, "the scorer had no session to terminate: nothing tested"

    # The signal: a non-zero exit, one error naming the credential problem, the reconnects
    # logged with their verb.
    assert failed.rc == 1, failed.out + failed.err
    # Fast: a refused login is not a lost connection, so no verb goes on retrying it with
    # backoff (database.reconnecting): a query cut by the terminate reconnects once at most,
    # and the run gives up at the first refusal.
    assert failed.err.count("reconnecting in") <= 1, failed.err
    error = json.loads(failed.out)["error"]
    assert error["exit_code"] == 1
    message = error["message"]
    assert "\n" not in message
    assert "not permitted to log in" in message, message
    assert "ALTER ROLE NAME LOGIN" in message  # and what to do about it
    # The leases it could not give back are said so, with their ids (key=value).
    assert "items not released; they return when the lease expires lease_id=" in failed.err

    # Nothing is lost in the meantime: what was not committed is ready again or under a lease
    # that runs out; nothing is dead and no attempt is burnt beyond the one claim.
    states = drill.states()
    assert states["DONE"] < N, "the run finished before the revoke: nothing tested"
    assert states["DEAD"] == 0
    assert states["EXPIRED"] == 0
    time.sleep(LEASE_S + 0.5)
    # Reconcile (as an operator whose login still works) sees the leases nobody holds.
    stale = drill.reconcile("--json", db=drill.admin_url)
    assert stale.rc == 1, stale.out + stale.err
    found = {f["class"]: f for f in json.loads(stale.out)["findings"]}
    assert found["stale_lease"]["severity"] == "warning"
    assert found["stale_lease"]["count"] == states["LEASED"] > 0
    # ... and `batching metrics serve` shows them (queue gauges, from the table).
    assert drill.gauge("batching_queue_expired_leases") == states["LEASED"]

    drill.cluster.sql(f"ALTER ROLE {drill.role} LOGIN")
    again = drill.score()
    assert again.rc == 0, again.err
    verdict = assert_nothing_lost(drill, N)
    report(
        "credentials_revoked",
        items=verdict.items,
        lost=verdict.lost,
        duplicated=verdict.duplicated,
        done_before=states["DONE"],
        fail_s=f"{took_s:.1f}",
        exit_failed=failed.rc,
        stale_leases=states["LEASED"],
        exit_reconcile=stale.rc,
        exit_again=again.rc,
        rerun_s=f"{again.duration_s:.1f}",
    )
