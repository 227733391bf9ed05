"""The batch's k plan against fixed ks and plain decoding, in one process on one Batch, paired.

    python scripts/batch_policy.py --target DIR [--draft DIR | --head DIR] --speculator prompt-lookup \
        --sessions 8 --tokens 128 -k 3 --variants none,plan,fixed2 --repeats 8

Every repeat runs N Sessions once for each variant, in an order that alternates per repeat: ``none`` (plain
decoding), ``plan`` (the batch plans each round's k, as it serves), ``fixedK`` (every round drafts K, the
plan and guards bypassed; ``fixed0``: Sessions with the speculator that never draft, which is what the
speculative machinery costs by itself). It prints each variant's median tokens a second and the median of its
ratio to the first variant *within each repeat*: this VM's speed drifts by tens of percent over minutes, and a
ratio of two runs seconds apart drifts much less than one of two medians. To compare two versions of the code,
run it once on each (``PYTHONPATH`` pointing at the other one's package) and compare the ratios.

``--requests R``: each Session runs R requests one after another (prompts cycling through the shipped ones), so
that requests join and leave mid-flight as a server's do, each with its prompt's chunks; with 1 (the default)
all start and end together. The variants share one Batch, and so its guards, unless ``--separate`` gives each
its own (and its own draft's Batch): then no variant's steps reach another's guard, which matters where the plan
is measured beside fixed ks.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

from batch_vs_openvino import at_once, generate_at_once


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--draft")
    p.add_argument("--head")
    p.add_argument("--speculator", default="prompt-lookup")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--variants", default="none,plan,fixed2")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--separate", action="store_true")
    args = p.parse_args()

    import rlxrt
    from rlxrt.app.flags import prompts_of
    from rlxrt.app.speculators import build
    from rlxrt.backends import compile
    from rlxrt.sessions import Batch, Session
    from rlxrt.sessions import batch as batching

    every = rlxrt.Config(intra_op_threads=os.cpu_count() or 1, cpu_kernels="rlxrt")
    one = rlxrt.Config(intra_op_threads=1, cpu_kernels="rlxrt")
    n, variants = args.sessions, args.variants.split(",")

    def engines():
        return Batch(args.target, every, slots=n), Batch(args.draft, every, slots=n, calibrate=False) \
            if args.draft else compile(args.head, one) if args.head else None

    shared = engines()
    pairs = {v: engines() if args.separate else shared for v in variants}
    texts = prompts_of(argparse.Namespace(prompt_file=None), n * args.requests)
    planned = batching.Slot.k_cap

    def fixed_k(k: int):
        def k_cap(slot, wanted: int, ks=None) -> int:
            slot.k_wanted = wanted
            for i in range(len(slot.caps)):
                slot.caps[i] = min(k, wanted if ks is None else min(wanted, ks[i]))
            slot._asked = True
            return max(slot.caps, default=0)
        return k_cap

    def run(variant: str, rep: int) -> float:
        batching.Slot.k_cap = planned  # every round drafts K, whatever the plan and the guards say:
        if variant.startswith("fixed"):
            batching.Slot.k_cap = fixed_k(int(variant[5:]))
        kind = "none" if variant == "none" else args.speculator
        batch, helper = pairs[variant]
        sessions = [Session(batch, build(kind, helper, one), every, **({"k": args.k} if kind != "none" else {}))
                    for _ in range(n)]
        if args.requests == 1:
            prompts = [s.prompt_ids(t) for s, t in zip(sessions, texts)]
            out, wall = generate_at_once(sessions, prompts, args.tokens)
            tokens = sum(len(o.token_ids) for o in out)
        else:
            tokens, wall = in_turn(sessions, rep, args.requests, args.tokens, texts)
        del sessions
        gc.collect()
        return tokens / wall

    rates: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(args.repeats):
        for v in variants if rep % 2 == 0 else variants[::-1]:
            rates[v].append(run(v, rep))
        print(f"  repeat {rep + 1}: " + ", ".join(f"{v} {r[-1]:.0f}" for v, r in rates.items()), file=sys.stderr)
    first = rates[variants[0]]
    print(f"| variant | tok/s (median) | vs {variants[0]}, paired (median) | min | max |\n| --- | --- | --- | --- | --- |")
    for v, r in rates.items():
        paired = [x / b for x, b in zip(r, first)]
        print(f"| {v} | {statistics.median(r):.1f} | {statistics.median(paired):.3f}x | {min(paired):.2f} | "
              f"{max(paired):.2f} |")
    return 0


def in_turn(sessions, rep: int, requests: int, max_tokens: int, texts: list[str]) -> tuple[int, float]:
    """Each Session runs ``requests`` requests one after another on its own thread, all Sessions at once (the
    prompts shift by one each repeat): (the tokens generated, the wall time)."""
    counts = [0] * len(sessions)

    def one(i: int) -> None:
        for r in range(requests):
            text = texts[(rep + i * requests + r) % len(texts)]
            g = sessions[i].generate(sessions[i].prompt_ids(text), max_new_tokens=max_tokens, ignore_eos=True)
            counts[i] += len(g.token_ids)

    wall = at_once(len(sessions), one)
    return sum(counts), wall


if __name__ == "__main__":
    sys.exit(main())
