"""The input role of a parallel run (``input.py``: ``_Input``, ``input_main``) and what
only it uses: the ledger of events sent and not yet confirmed (``ledger.py``), the
queue of re-sends (``resend.py``), the workers coming and going (``roster.py``), the
encoded-event fast path (``fastpath.py``) and the checkpoint (``checkpoint.py``), whose
file the parent plans and the output reopens.
"""
