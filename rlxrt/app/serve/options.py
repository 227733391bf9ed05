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
ENGINES = ("auto", "batch", "pool")
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
    """Sessions (and worker threads) of one server or replica: under the batch engine, the sequences its steps
    decode at once (the slots of its KV buffers)."""
    engine: str = "auto"
    """batch (every worker's Session a slot of one batched graph: ``sessions/batch.py``), pool (each worker's
    Session decodes alone) or auto (batch where the target can, else pool)."""
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
        if self.engine not in ENGINES:
            raise UsageError(f"--engine {self.engine!r} is unknown; use one of {', '.join(ENGINES)}")
        if not 1 <= self.workers <= 256:
            raise InputError(f"--workers must be in 1..256, got {self.workers}")
        if not 0 <= self.max_queue <= 1_000_000:
            raise InputError(f"--max-queue must be in 0..1000000, got {self.max_queue}")
        if not 0 < self.request_timeout <= 86_400:
            raise InputError(f"--request-timeout must be in (0, 86400] seconds, got {self.request_timeout}")

    @property
    def name(self) -> str:
        return self.model_name or Path(self.target).resolve().name


def default_threads(workers: int, engine: str = "pool") -> int:
    """Intra-op threads per worker: the cores shared out among the pool's workers (at least 1); every core for
    a batch's steps, which run one at a time."""
    return (os.cpu_count() or 1) if engine != "pool" else max(1, (os.cpu_count() or 1) // workers)


def make_server(opts: ServeOptions):
    from rlxrt.sessions import Session

    from ..speculators import build

    from .app import Server
    from .metrics import Metrics
    from .pool import Pool

    config = opts.config
    target, engine, why = _target(opts)
    helper = _helper(opts, engine, target)

    def make_session():
        return Session(target, build(opts.speculator, helper, helper.config if helper else config, opts.min_prob),
                       config, k=opts.k, adaptive_k=opts.adaptive_k)

    holder = {}
    metrics = Metrics(opts.name, lambda: holder["pool"])
    pool = holder["pool"] = Pool(make_session, opts.workers, opts.max_queue, metrics.record,
                                  driven=engine == "batch")
    from rlxrt.sessions.batch import Batch

    from rlxrt.sessions.head_batch import HeadBatch

    drafts = None if not model_of(opts.speculator) else "batch" if isinstance(helper, (Batch, HeadBatch)) else "each"
    return Server(pool, opts.name, metrics, opts.request_timeout, engine=engine, engine_reason=why, drafts=drafts,
                  batch=target if engine == "batch" else None)


def _target(opts: ServeOptions):
    """(the target every Session decodes on, the engine, why not the batch): a Batch of ``workers`` slots, or the
    compiled graph the pool's Sessions share; ``auto`` takes the batch where the target can be batched and says
    why not else."""
    import logging

    from rlxrt.backends import compile
    from rlxrt.errors import ProviderError
    from rlxrt.sessions.batch import Batch

    why = "--engine pool"
    if opts.engine != "pool":
        try:
            return Batch(opts.target, opts.config, slots=opts.workers), "batch", None
        except ProviderError as exc:
            if opts.engine == "batch":
                raise
            why = str(exc)
            logging.getLogger("rlxrt.serve").warning("serving with the pool engine: %s", why)
    return compile(opts.target, opts.config), "pool", why


def _helper(opts: ServeOptions, engine: str, target=None):
    """The draft model or head: under the batch engine a draft model's own Batch, or a head's HeadBatch, where
    it can batch (every Session's drafts then run in one step, on every core), else its graph with one intra-op
    thread (each Session drafts on its own, beside the others); the pool's Sessions share the compiled graph."""
    import dataclasses
    import logging

    from rlxrt.backends import compile
    from rlxrt.errors import ProviderError
    from rlxrt.sessions.batch import Batch

    if not model_of(opts.speculator):
        return None
    if engine == "batch" and model_of(opts.speculator) == "draft":
        try:
            return Batch(opts.draft, opts.config, slots=opts.workers, calibrate=False)
        except ProviderError as exc:
            logging.getLogger("rlxrt.serve").warning("the draft drafts alone in each Session: %s", exc)
    if engine == "batch" and model_of(opts.speculator) == "mtp":
        from rlxrt.sessions.head_batch import HeadBatch

        try:
            capacity = getattr(target, "capacity", None)  # the head reads no further than its target
            return HeadBatch(opts.draft, opts.config, slots=opts.workers, capacity=capacity)
        except ProviderError as exc:
            logging.getLogger("rlxrt.serve").warning("the head drafts alone in each Session: %s", exc)
    config = dataclasses.replace(opts.config, intra_op_threads=1) if engine == "batch" else opts.config
    return compile(opts.draft, config)
