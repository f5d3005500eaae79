"""The SQL database every layer shares: URLs and engines (:mod:`.database`), the tables
and their numbered migrations (:mod:`.schema`), SQLite's set-up and writer lock
(:mod:`.sqlite`).
"""
