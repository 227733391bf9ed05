"""The ``rlxrt serve`` and ``rlxrt bench-serve`` commands."""
from __future__ import annotations

import argparse
import math

from rlxrt.errors import InputError, MissingDependencyError, UsageError

from ..speculators import KINDS as SPECULATORS
from ..speculators import model_of

BATCH_WORKERS = 16
"""Sequences a batch engine decodes at once when --workers is not given."""


def add_serve_commands(add, runtime_flags) -> None:
    p = add("serve", cmd_serve, "serve a model over an OpenAI-compatible HTTP API (completions, chat, streaming, "
                                "metrics) with speculative decoding; no model flags: the shipped pair")
    model_flags(p)
    p.add_argument("--engine", choices=["auto", "batch", "pool"], default="auto",
                   help="batch: one batched step decodes every request in flight (continuous batching; a fused "
                        "target on rlxrt's CPU kernels); pool: each worker decodes its request alone; auto "
                        "(default): batch where the target can")
    p.add_argument("--workers", type=int, help="requests decoded at once: the batch's sequences (default 16) or "
                                               "the pool's Sessions (default: the CPU count, at most 8)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a worker before 429 (default 64)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take, queue "
                                                                       "included, before 504 (default 600)")
    p.add_argument("--model-name", help="the model id clients send (default: the target directory's name)")
    p.add_argument("--ray", action="store_true", help="run on Ray Serve (pip install 'rlxrt[ray]')")
    p.add_argument("--replicas", type=int, default=2, help="Ray Serve replicas (with --ray; default 2)")
    p.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    runtime_flags(p, threads=None)

    from .loadgen import add_bench_serve

    add_bench_serve(add, model_flags)


def model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model directory (default: the shipped reference target)")
    p.add_argument("--draft", help="draft model directory (default with the shipped target: the shipped draft)")
    p.add_argument("--head", help="MTP head directory (drafts from the target's hidden states)")
    p.add_argument("--speculator", choices=list(SPECULATORS),
                   help="default: draft with --draft, mtp with --head, else none (plain decoding); lookup+X: "
                        "prompt lookup where the text repeats itself, else X")
    p.add_argument("-k", type=int, help="tokens drafted per round, 1..32 (default: 2 for a draft model or head, "
                                        "4 for prompt lookup)")
    p.add_argument("--min-draft-prob", type=float, default=0.0, metavar="P",
                   help="a draft model's or head's chain ends where its likeliest token is below P (exact either "
                        "way); 0 (default): k tokens every round")
    p.add_argument("--adaptive-k", action="store_true",
                   help="each worker picks every round's k (1..2k) for the most tokens a second, from its rounds "
                        "so far")


def options_from(args: argparse.Namespace, workers: int, config):
    """ServeOptions from the model flags (``--target``/``--draft``/``--head``/``--speculator``, or none: the
    shipped pair with its draft)."""
    from ..reference import reference_pair
    from .options import SERVE_MODEL_K, ServeOptions

    if args.draft and args.head:
        raise UsageError("--draft and --head exclude each other: pass one speculator")
    if args.target is None:
        if args.draft or args.head:
            raise UsageError("--draft/--head need --target (or pass neither, for the shipped pair)")
        target, draft = map(str, reference_pair(config))
        speculator = args.speculator or "draft"
        helper = draft if model_of(speculator) == "draft" else None
        if model_of(speculator) == "mtp":
            from ..flags import head_dir

            helper = str(head_dir(None, None))
    else:
        target, helper = args.target, args.draft or args.head
        speculator = args.speculator or ("draft" if args.draft else "mtp" if args.head else "none")
        model = model_of(speculator)
        if (model == "draft" and args.head) or (model == "mtp" and args.draft):
            raise UsageError(f"--speculator {speculator} does not take {'--head' if args.head else '--draft'}")
        if model is None and helper:
            raise UsageError(f"--speculator {speculator} runs no draft model; drop --draft/--head")
    if args.k is not None and speculator == "none":
        raise UsageError("-k needs a speculator (--draft, --head or --speculator prompt-lookup); plain decoding "
                         "drafts nothing")
    if args.k is not None and not 1 <= args.k <= 32:
        raise InputError(f"-k must be in 1..32, got {args.k}")
    name = args.model_name or ("rlxrt-reference" if args.target is None else None)
    k = args.k if args.k is not None else SERVE_MODEL_K if model_of(speculator) else None
    return ServeOptions(target=target, speculator=speculator, draft=helper, k=k, config=config,
                        min_prob=args.min_draft_prob, adaptive_k=args.adaptive_k, workers=workers,
                        max_queue=args.max_queue, engine=getattr(args, "engine", "auto"),
                        request_timeout=args.request_timeout, model_name=name)


def _require(module: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingDependencyError(f"`rlxrt serve{' --ray' if extra == 'ray' else ''}` needs {module}: "
                                     f"pip install 'rlxrt[{extra}]'")


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from ..flags import config_of
    from .options import default_threads

    for module in ("fastapi", "uvicorn", "prometheus_client"):
        _require(module, "serve")
    workers = args.workers if args.workers is not None else \
        min(8, os.cpu_count() or 1) if args.engine == "pool" else BATCH_WORKERS
    if not 1 <= workers <= 256:
        raise InputError(f"--workers must be in 1..256, got {workers}")
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be in 0..65535, got {args.port}")
    if not (math.isfinite(args.request_timeout) and args.request_timeout > 0):
        raise InputError(f"--request-timeout must be a positive number of seconds, got {args.request_timeout}")
    opts = options_from(args, workers, config_of(args, intra_op_threads=default_threads(workers, args.engine)))
    if args.ray:
        _require("ray", "ray")
        if args.replicas < 1:
            raise InputError(f"--replicas must be >= 1, got {args.replicas}")
        from .run import serve_ray

        serve_ray(opts, args.host, args.port, args.replicas, args.ray_address)
        return 0
    from .run import serve_uvicorn

    serve_uvicorn(opts, args.host, args.port, args.log_level)
    return 0
