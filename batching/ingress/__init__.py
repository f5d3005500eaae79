"""Requests in: the queue table and its verbs (:mod:`.queue`), a SQLite claim's read-back
(:mod:`.sqlite_claim`), request files (:mod:`.ingest`), the run ledger (:mod:`.run_ledger`), and
wake-ups on commit for scorers and long-polling readers (:mod:`.watch`).
"""
