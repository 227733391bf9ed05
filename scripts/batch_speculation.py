"""Speculation on a Batch, in process: N Sessions at once, plain against each speculator, interleaved.

    python scripts/batch_speculation.py --target DIR [--head DIR] [--draft DIR] --sessions 8 --tokens 128 \
        --speculators none,prompt-lookup,mtp,lookup+mtp -k 3 --repeats 2 [--force-k K]

Every repeat runs N Sessions of each speculator on one Batch (the shipped code prompts, greedy, EOS ignored),
in an order that alternates per repeat, and prints tokens a second, the batch's steps, what was drafted and
accepted, and what the batch measured of drafting (the gap between steps with nothing drafted, and what a
drafted token of each source adds to it; for a Cascade, the rounds each source drafted). ``--force-k K``
replaces the plan by K for every sequence and turns the guards off: what drafting K would give, for comparison with what the plan chose. A draft model drafts on a Batch of its
own (``DraftModel(draft_batch)``). Medians, relative to plain, at the end.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys

from batch_vs_openvino import generate_at_once


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--head")
    p.add_argument("--draft")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--speculators", default="none,lookup+mtp")
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--force-k", type=int, default=-1)
    args = p.parse_args()
    import os

    import rlxrt
    from rlxrt.app.flags import prompts_of
    from rlxrt.app.speculators import build, model_of
    from rlxrt.backends import compile
    from rlxrt.sessions import Batch, Session
    from rlxrt.sessions import batch as batching
    from rlxrt.sessions.k_policy import Guard

    if args.force_k >= 0:
        batching.plan_ks = lambda cost, seqs, overhead=0.0, slots=None, context=0.0: [args.force_k] * len(seqs)
        Guard.step = lambda self, *record: None
    every = rlxrt.Config(intra_op_threads=os.cpu_count() or 1, cpu_kernels="rlxrt")
    one = rlxrt.Config(intra_op_threads=1, cpu_kernels="rlxrt")
    n = args.sessions
    batch = Batch(args.target, every, slots=n)
    helpers = {"mtp": compile(args.head, one) if args.head else None,
               "draft": Batch(args.draft, every, slots=n, calibrate=False) if args.draft else None}
    texts = prompts_of(argparse.Namespace(prompt_file=None), n)[:n]

    def run(kind: str) -> float:
        helper = helpers.get(model_of(kind) or "")
        sessions = [Session(batch, build(kind, helper, one), every, **({"k": args.k} if kind != "none" else {}))
                    for _ in texts]
        prompts = [s.prompt_ids(t) for s, t in zip(sessions, texts)]
        steps = batch.steps
        out, wall = generate_at_once(sessions, prompts, args.tokens)
        rate = sum(len(o.token_ids) for o in out) / wall
        print(f"  {kind:<14} {rate:7.1f} tok/s  steps {batch.steps - steps:4d}  drafted "
              f"{sum(o.stats.drafted for o in out):5d}  accepted {sum(o.stats.accepted for o in out):5d}  "
              f"gap {batch.draft_cost(n).overhead * 1e3:.2f} ms", file=sys.stderr)
        costs = {name: batch.draft_cost(n).per_token(name) for name in batch.draft_cost(n).drafting}
        if costs:
            print("    a drafted token adds:", ", ".join(f"{n} {c * 1e3:.2f} ms" for n, c in costs.items()),
                  file=sys.stderr)
        spec = sessions[0].speculator
        if spec is not None and spec.drafters > 1:  # a Cascade: the rounds each source drafted
            by = [sum(s.speculator.proposed_by[i] for s in sessions) for i in range(spec.drafters)]
            print("    rounds drafted by:", ", ".join(f"{n} {r}" for n, r in zip(spec.source_names, by)),
                  file=sys.stderr)
        if kind != "none":
            guards = {batching.load_label(load): g for load, g in sorted(batch.guards.items())}
            print("    guards, tok/s drafting / not (sequences a step):", ", ".join(
                f"{n} {_rate(g.rates[True])} / {_rate(g.rates[False])}" for n, g in guards.items()), file=sys.stderr)
        del sessions
        gc.collect()
        return rate

    kinds = args.speculators.split(",")
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    for rep in range(args.repeats):
        for kind in kinds if rep % 2 == 0 else kinds[::-1]:
            rates[kind].append(run(kind))
    base = statistics.median(rates[kinds[0]])
    print(f"| speculator | tok/s | vs {kinds[0]} |\n| --- | --- | --- |")
    for kind, r in rates.items():
        print(f"| {kind} | {statistics.median(r):.1f} | {statistics.median(r) / base:.2f}x |")
    return 0


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0f}"


if __name__ == "__main__":
    sys.exit(main())
