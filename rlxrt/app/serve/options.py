"""What a server (or one Ray replica) is built from, and how: ``ServeOptions`` is plain data (it travels to Ray
replicas); ``make_server`` compiles the graphs once and gives every worker its own Session on them."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rlxrt.config import Config
from rlxrt.errors import InputError, UsageError

from ..speculators import KINDS as SPECULATORS
from ..speculators import model_of
SERVE_MODEL_K = 2
"""Draft length of a served draft model or head when -k is not given. Under load every rejected drafted token
costs worker time another request could use, so a server drafts less than one stream alone would (measured:
docs/performance.md, "Serving throughput")."""


@dataclass(frozen=True)
class ServeOptions:
    target: str
    """Target model directory."""
    speculator: str = "none"
    """draft, mtp, prompt-lookup, lookup+draft, lookup+mtp or none (plain decoding)."""
    draft: str | None = None
    """Draft model directory (speculator draft, lookup+draft) or MTP head directory (mtp, lookup+mtp)."""
    k: int | None = None
    """Tokens drafted per round (None: the speculator's default)."""
    config: Config = Config()
    min_prob: float = 0.0
    """A draft model's or head's chain ends where its likeliest token is below this (0: k tokens a round)."""
    adaptive_k: bool = False
    """Each worker's Session picks every round's k in 1..2k from what its rounds cost and earn."""
    workers: int = 1
    """Sessions (and worker threads) of one server or replica."""
    max_queue: int = 64
    """Requests admitted beyond the busy workers before 429."""
    request_timeout: float = 600.0
    """Seconds from arrival after which a request ends with 504 (checked every round)."""
    model_name: str | None = None
    """The model id clients send (default: the target directory's name)."""

    def __post_init__(self):
        if self.speculator not in SPECULATORS:
            raise UsageError(f"speculator {self.speculator!r} is unknown; use one of {', '.join(SPECULATORS)}")
        model = model_of(self.speculator)
        if model and not self.draft:
            raise UsageError(f"speculator {self.speculator} needs {'--draft' if model == 'draft' else '--head'} DIR")
        if not 0 <= self.min_prob < 1:
            raise InputError(f"--min-draft-prob must be in [0, 1), got {self.min_prob}")
        if self.min_prob and not model:
            raise UsageError(f"--min-draft-prob needs a draft model or head; speculator {self.speculator} runs neither")
        if self.adaptive_k and self.speculator == "none":
            raise UsageError("--adaptive-k needs a speculator (--draft, --head or --speculator prompt-lookup); plain "
                             "decoding drafts nothing")
        if not 1 <= self.workers <= 256:
            raise InputError(f"--workers must be in 1..256, got {self.workers}")
        if not 0 <= self.max_queue <= 1_000_000:
            raise InputError(f"--max-queue must be in 0..1000000, got {self.max_queue}")
        if not 0 < self.request_timeout <= 86_400:
            raise InputError(f"--request-timeout must be in (0, 86400] seconds, got {self.request_timeout}")

    @property
    def name(self) -> str:
        return self.model_name or Path(self.target).resolve().name


def default_threads(workers: int) -> int:
    """Intra-op threads per worker: the cores shared out among the workers (at least 1)."""
    return max(1, (os.cpu_count() or 1) // workers)


def make_server(opts: ServeOptions):
    from rlxrt.backends import compile
    from rlxrt.sessions import Session

    from ..speculators import build

    from .app import Server
    from .metrics import Metrics
    from .pool import Pool

    config = opts.config
    target = compile(opts.target, config)
    helper = compile(opts.draft, config) if model_of(opts.speculator) else None

    def make_session():
        return Session(target, build(opts.speculator, helper, config, opts.min_prob), config, k=opts.k,
                       adaptive_k=opts.adaptive_k)

    holder = {}
    metrics = Metrics(opts.name, lambda: holder["pool"])
    pool = holder["pool"] = Pool(make_session, opts.workers, opts.max_queue, metrics.record)
    return Server(pool, opts.name, metrics, opts.request_timeout)
