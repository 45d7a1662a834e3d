"""The output role of a parallel run (``output.py``: ``_Output``, ``output_main``) and
what only it uses: the uids it wrote (``dedup.py``), the ``--ordered`` buffer
(``reorder.py``) and its account of persistent-object fills (``fills.py``).
"""
