"""Requests in: the queue table and its verbs (:mod:`.queue`), a SQLite claim's read-back
(:mod:`.sqlite_claim`), request files (:mod:`.ingest`), and the run ledger
(:mod:`.run_ledger`).
"""
