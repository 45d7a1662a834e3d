"""The worker role of a parallel run (``worker.py``: ``_Worker``, ``worker_main``) and its
lazily decoded events (``lazystore.py``: ``LazyEvent``, which the output and the HLT
event builder read too).
"""
