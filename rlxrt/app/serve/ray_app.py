"""The server as a Ray Serve deployment: each replica builds its own pool of Sessions and serves the same
FastAPI app. Start it with ``rlxrt serve --ray --replicas N``, or with Ray's own CLI::

    serve run rlxrt.app.serve.ray_app:build target=DIR draft=DIR replicas=2 workers=1
"""
from __future__ import annotations

from typing import Any

from .options import ServeOptions


class Replica:
    def __init__(self, opts: ServeOptions):
        from .options import make_server

        self.server = make_server(opts)

    def __serve_build_asgi_app__(self):
        from .app import build_app

        return build_app(self.server)


def deployment(opts: ServeOptions, replicas: int):
    """The bound Ray Serve application: ``replicas`` replicas of ``Replica(opts)``."""
    from ray import serve

    cls = serve.ingress()(Replica)
    # each replica's ORT sessions use their own threads; ask Ray for no CPU so replicas fit on small machines
    return serve.deployment(cls, name="rlxrt", num_replicas=replicas,
                            ray_actor_options={"num_cpus": 0},
                            max_ongoing_requests=max(1, opts.workers + opts.max_queue)).bind(opts)


def build(args: dict[str, Any]):
    """Ray's application builder: ``serve run rlxrt.app.serve.ray_app:build target=DIR [draft=DIR]
    [speculator=draft|mtp|prompt-lookup|lookup+draft|lookup+mtp|none] [k=4] [workers=1] [replicas=2] [threads=1]
    [max_queue=64] [min_draft_prob=0.3] [engine=auto|batch|pool]``."""
    from rlxrt.config import load_config

    from ..reference import reference_pair
    from ..speculators import model_of
    from .options import SERVE_MODEL_K, default_threads

    known = {"target", "draft", "speculator", "k", "workers", "replicas", "threads", "max_queue", "request_timeout",
             "model_name", "providers", "min_draft_prob", "adaptive_k", "engine"}
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    workers = int(args.get("workers", 1))
    config = load_config(None, providers=args.get("providers"),
                         intra_op_threads=int(args.get("threads", default_threads(workers))))
    target, draft = (args["target"], args.get("draft")) if "target" in args else map(str, reference_pair(config))
    speculator = args.get("speculator", "draft" if draft else "none")
    k = int(args["k"]) if "k" in args else SERVE_MODEL_K if model_of(speculator) else None
    opts = ServeOptions(target=str(target), speculator=speculator, draft=draft, k=k, config=config,
                        min_prob=float(args.get("min_draft_prob", 0.0)),
                        adaptive_k=str(args.get("adaptive_k", "false")).strip().lower() in ("1", "true", "yes", "on"),
                        workers=workers, engine=str(args.get("engine", "auto")),
                        max_queue=int(args.get("max_queue", 64)),
                        request_timeout=float(args.get("request_timeout", 600)), model_name=args.get("model_name"))
    return deployment(opts, int(args.get("replicas", 1)))
