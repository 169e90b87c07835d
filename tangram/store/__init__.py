"""Persistence of the broker: action records, their state transitions, learned duration profiles, the runs of
learned speed-up models, API tokens and the SLO plans made through the API.

``store.Store`` is what the broker holds; it writes behind (``group_commit``), reads what it has not written yet
before the database, and opens SQLite or PostgreSQL (``engine``). The tables are in ``tables``.
"""
