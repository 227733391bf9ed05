"""rlxrt.sessions: the Session, KV caches, the decode loop, one file per speculator."""
from .batch import Batch
from .cascade import Cascade
from .draft_model import DraftModel
from .driver import Driver
from .head_batch import HeadBatch
from .kv import KVModel
from .mtp_head import MtpHead
from .prompt_lookup import PromptLookup
from .session import Generation, Session
from .state import StateModel, decoder_for

__all__ = ["Batch", "Cascade", "DraftModel", "Driver", "Generation", "HeadBatch", "KVModel", "MtpHead", "PromptLookup", "Session", "StateModel", "decoder_for"]
