"""Neutral pieces every API family may use (and no family owns): field checking
(``fields.py``), other servers' constraint fields (``constraint_fields.py``), the shared
wire shapes (``wire.py``), the chat turns and tools (``messages.py``) and their prompt
(``chat.py``)."""
