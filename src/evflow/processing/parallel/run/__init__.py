"""The caller of a parallel run: it starts the roles, watches them, restarts or stops
them and builds the summary (``engine.py``: ``Parent``; the crash-loop backoff in
``restarts.py``), and its variant with workers on other hosts (``farm.py``:
``FarmParent``; ``farmplan.py``; the agents' side, ``pathworkers.py``).
"""
