"""Sessions on a Batch under one Driver, in process: plain rounds against a speculator's, held in plain or drafting.

    python scripts/driver_rounds.py [--target DIR] [--draft DIR | --head DIR] [--speculator draft] [-k 2] \
        [--sessions 8] [--requests 64] [--repeats 9] [--modes plain,held] [--no-run]

Modes, each with a Batch of its own (the shipped target and draft by default; a draft on a Batch of its own,
a head on a HeadBatch, as the server runs them): ``plain`` (Sessions without a speculator), ``held`` (the
speculator with every guard held in plain steps: it never drafts), ``drafting`` (every guard held drafting: the
plan still chooses each round's k) and ``spec`` (the guards as they ship).
SESSIONS Sessions run REQUESTS requests of TOKENS tokens between them; repeats interleave the modes, the order
reversed every other one. For each mode: its median tokens a second, its ratio to the first mode's in every
repeat, and the seconds of a run outside ONNX Runtime (the wall time less every Batch's and HeadBatch's calls),
medians. ``--no-run`` makes every target step's call a no-op (the logits stay zeros; the shipped pair only):
what is left is the Python of the rounds and steps, per token the inverse of its tokens a second.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--head")
    p.add_argument("--speculator", default="draft")
    p.add_argument("-k", type=int, default=2)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--requests", type=int, default=64, help="requests the Sessions run between them")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--modes", default="plain,held", help="of plain, held, drafting, spec; the first is the baseline")
    p.add_argument("--no-run", action="store_true", help="every step's ONNX Runtime call a no-op: Python alone")
    args = p.parse_args()

    from rlxrt.app.flags import prompts_of
    from rlxrt.app.reference import reference_pair
    from rlxrt.app.speculators import build
    from rlxrt.sessions import Driver, Session
    from rlxrt.sessions import batch as batching
    from rlxrt.sessions.head_batch import HeadBatch

    runs = {"seconds": 0.0}
    timed(batching.Batch, runs)
    timed(HeadBatch, runs)
    if args.no_run:
        batching.Batch._run = lambda self, tokens, sequences, rows: 1e-5
    target, draft = (str(d) for d in reference_pair())
    target, draft = args.target or target, args.draft or (draft if not args.head else None)
    prompts = prompts_of(argparse.Namespace(prompt_file=None), 64)
    modes = args.modes.split(",")
    sessions = {}
    for mode in modes:
        batch = batching.Batch(target, slots=args.sessions)
        if mode == "plain":
            sessions[mode] = [Session(batch) for _ in range(args.sessions)]
            continue
        helper = HeadBatch(args.head, slots=args.sessions, capacity=batch.capacity) if args.head else \
            batching.Batch(draft, slots=args.sessions, calibrate=False)
        sessions[mode] = [Session(batch, build(args.speculator, helper, None), k=args.k)
                          for _ in range(args.sessions)]
        if mode in ("held", "drafting"):
            batch.guard = held(batch, mode == "drafting")

    def run(mode: str) -> tuple[float, float]:
        driver, todo, done = Driver(), list(range(args.requests)), [0]

        def worker(session):
            while todo:
                i = todo.pop()
                g = session.generate(prompts[i % len(prompts)], max_new_tokens=args.tokens, ignore_eos=True)
                done[0] += len(g.token_ids)

        for s in sessions[mode]:
            driver.spawn(worker, s)
        runs["seconds"] = 0.0
        start = time.perf_counter()
        driver.run()
        seconds = time.perf_counter() - start
        driver.close()
        return done[0] / seconds, seconds - runs["seconds"]

    rates: dict[str, list[float]] = {m: [] for m in modes}
    outside: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            rate, rest = run(mode)
            rates[mode].append(rate)
            outside[mode].append(rest)
    base = rates[modes[0]]
    for mode in modes:
        ratios = [x / y for x, y in zip(rates[mode], base)]
        print(f"{mode}: median {statistics.median(rates[mode]):.0f} tok/s, outside ONNX Runtime "
              f"{statistics.median(outside[mode]):.3f} s a run; / {modes[0]} median {statistics.median(ratios):.3f}, "
              f"each {', '.join(f'{r:.3f}' for r in ratios)}")
    return 0


def timed(cls, runs: dict) -> None:
    """Every ``cls._run`` call's seconds added to ``runs["seconds"]``."""
    run = cls._run

    def _run(self, *args):
        start = time.perf_counter()
        try:
            return run(self, *args)
        finally:
            runs["seconds"] += time.perf_counter() - start

    cls._run = _run


def held(batch, drafting: bool):
    """``batch.guard`` with every guard it makes held in one mode."""
    make = batch.guard

    def guard(sequences: int):
        g = make(sequences)
        g.drafting, g._switch = drafting, lambda drafting, phase: None
        return g

    return guard


if __name__ == "__main__":
    raise SystemExit(main())
