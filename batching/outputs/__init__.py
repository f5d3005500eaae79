"""Outputs, exactly once: the contract every sink satisfies (:mod:`.contract`), the batch
ledger (:mod:`.ledger`), the sinks (:mod:`.parquet`, :mod:`.sql`, :mod:`.delta`, through
:mod:`.outbox` for outputs outside the queue's database), and the registry that opens the
one a config names (:mod:`.registry`).
"""
