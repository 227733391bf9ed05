"""Upper bounds on what one request or one session may ask for.

Each bound keeps a typo or a hostile request from hanging the machine or
exhausting memory; the error that enforces it names the bound.
"""
from __future__ import annotations

MAX_THREADS = 256
"""intra_op_threads / inter_op_threads (ORT creates one OS thread per unit)."""
K_MAX = 32
"""Tokens drafted per round (a verification's cost grows with its rows long before k reaches this)."""
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
MAX_USER_FILE_BYTES = 64 << 20
"""A file a user names (prompt file, prompt list, config file); a training corpus may be larger
(``MAX_CORPUS_BYTES``)."""
MAX_CORPUS_BYTES = 2 << 30
"""One training-corpus file of ``rlxrt train-head`` or ``rlxrt distill``."""
MAX_MANIFEST_BYTES = 4 << 20
"""A model directory's ``rlxrt.json``."""
MAX_GRAPH_BYTES = 2 << 30
"""A model's ``.onnx`` file without its external data (protobuf's own limit)."""
MAX_TOKENIZER_BYTES = 256 << 20
"""A model directory's ``tokenizer.json``."""
MAX_TEMPLATE_BYTES = 1 << 20
"""A model directory's chat template."""
MAX_ID_LIST_BYTES = 64 << 20
"""A model directory's list of token ids (a draft-only export's ``draft_vocab`` ids)."""
TEMPLATE_SECONDS = 5.0
"""Seconds a chat template may take to render one request (its own process is stopped then)."""
TEMPLATE_MEMORY_BYTES = 512 << 20
"""Address space of a chat template's renderer process."""
