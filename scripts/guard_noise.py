"""How well a guard can tell two modes apart on this machine: an A/A test on one mode's own steps.

    python scripts/guard_noise.py --target DIR --draft DIR [--sessions 2] [--requests 8] [--tokens 256]

N Sessions with a draft model run in process on a Batch (driven, as the server runs them), every round
drafting nothing, and the guard's step records (seconds, tokens) are kept. Both "modes" of the test are then
the same mode, so any difference between them is the machine's: it prints the standard deviation of

- a window of W steps against the mean of the windows either side of it (what ``k_policy.Guard`` does: one
  window of the other mode against the kept mode's windows around it), for W = 16, 64, 256;
- two halves of P steps taken alternately, B steps each (what a guard measuring the modes in turn would do;
  docs/performance.md, stop 59), for B = 1, 2, 4, 16 and P = 64, 128, 256.

A guard can tell apart only modes further apart than about twice these figures.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

from batch_vs_openvino import at_once


def records(args) -> list[tuple[float, int]]:
    import rlxrt
    from rlxrt.app.flags import prompts_of
    from rlxrt.app.speculators import build
    from rlxrt.sessions import Batch, Session
    from rlxrt.sessions import batch as batching
    from rlxrt.sessions import k_policy

    every = rlxrt.Config(intra_op_threads=os.cpu_count() or 1, cpu_kernels="rlxrt")
    one = rlxrt.Config(intra_op_threads=1, cpu_kernels="rlxrt")
    n = args.sessions
    target, draft = Batch(args.target, every, slots=n), Batch(args.draft, every, slots=n, calibrate=False)
    kept: list[tuple[float, int]] = []
    step = k_policy.Guard.step

    def record(self, drafting, seconds, tokens):
        kept.append((seconds, tokens))
        step(self, drafting, seconds, tokens)

    def nothing(slot, wanted: int, ks=None) -> int:  # every round drafts nothing, whatever the guard says
        slot.k_wanted = wanted
        slot.caps = [0] * len(slot.caps)
        slot._asked = True
        return 0

    k_policy.Guard.step = record
    batching.Slot.k_cap = nothing
    sessions = [Session(target, build("draft", draft, one), every, k=2) for _ in range(n)]
    texts = prompts_of(argparse.Namespace(prompt_file=None), n * args.requests)

    def one_session(i: int) -> None:
        for r in range(args.requests):
            s = sessions[i]
            s.generate(s.prompt_ids(texts[i * args.requests + r]), max_new_tokens=args.tokens, ignore_eos=True)

    at_once(n, one_session)
    return kept


def rate(steps: list[tuple[float, int]]) -> float:
    return sum(t for _, t in steps) / sum(s for s, _ in steps)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--sessions", type=int, default=2)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args()
    steps = records(args)
    print(f"{len(steps)} steps of {args.sessions} sequences, plain", file=sys.stderr)
    print("| comparison | steps | sd of the ratio | comparisons |\n| --- | --- | --- | --- |")
    for w in (16, 64, 256):
        windows = [rate(steps[i:i + w]) for i in range(0, len(steps) - w + 1, w)]
        ratios = [windows[i] / (0.5 * (windows[i - 1] + windows[i + 1])) for i in range(1, len(windows) - 1)]
        if len(ratios) > 1:
            print(f"| a window against the windows either side | {w} | {statistics.pstdev(ratios):.3f} | {len(ratios)} |")
    for block in (1, 2, 4, 16):
        for phase in (64, 128, 256):
            ratios = []
            for s0 in range(0, len(steps) - phase + 1, phase):
                part = steps[s0:s0 + phase]
                halves = [[x for j, x in enumerate(part) if (j // block) % 2 == h] for h in (0, 1)]
                ratios.append(rate(halves[0]) / rate(halves[1]))
            if len(ratios) > 1:
                print(f"| two halves, {block} steps each in turn | {phase} | {statistics.pstdev(ratios):.3f} | "
                      f"{len(ratios)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
