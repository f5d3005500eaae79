"""HTTP ingress (``batching api``): clients that are not SQL clients enqueue items and read
their results back over HTTP.

:mod:`.tokens` (bearer tokens bound to tenants), :mod:`.requests` (request bodies into
``EnqueueRecord``s, through ``ingress.ingest``'s checks), :mod:`.results` (an item's state and
its committed output row, read through the ledger and the sink), :mod:`.app` (the FastAPI
application: the only module that imports fastapi).
"""
