"""Upper bounds on what one request or one session may ask for.

Each bound keeps a typo or a hostile request from hanging the machine or
exhausting memory; the error that enforces it names the bound.
"""
from __future__ import annotations

MAX_THREADS = 256
"""intra_op_threads / inter_op_threads (ORT creates one OS thread per unit)."""
K_MAX = 32
"""Tokens drafted per round (a verify pass of k+1 rows costs ~1.6x a step already at k = 8)."""
MAX_NEW_TOKENS = 1 << 20
"""max_new_tokens of one request (the model's max positions usually end it much earlier)."""
MAX_STOP_STRINGS = 16
"""Stop strings of one request."""
MAX_STOP_LENGTH = 256
"""Characters of one stop string (1..this)."""
MAX_STOP_TOKEN_IDS = 256
"""Extra stop token ids of one request."""
MAX_CHAT_MESSAGES = 1024
"""Messages of one chat request."""
