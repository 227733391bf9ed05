"""What a head's call costs, batched and alone: the one-sequence head graph against the batched one (HeadBatch)
at 1, 2, 4, 8 and 16 sequences of one row each, at a context of --context tokens, and a catch-up of that many
rows; medians of --repeats interleaved passes, in ms.

    python scripts/head_calls.py [--head DIR] [--threads 2] [--context 300] [--repeats 200]

The head's attention cache and state are filled from random tokens and hidden states; after each call the
slot commits back to the context, so every pass reads the same cache.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    from rlxrt.app.flags import head_dir
    from rlxrt.backends import compile
    from rlxrt.config import Config
    from rlxrt.sessions import HeadBatch
    from rlxrt.sessions.state import StateModel

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", default=None, help="MTP head directory (default: the shipped pair's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    head = args.head or str(head_dir(None, None))
    config = Config(intra_op_threads=args.threads)
    sizes = (1, 2, 4, 8, 16)
    batch = HeadBatch(head, config, slots=max(sizes))
    slots = [batch.slot() for _ in range(max(sizes))]
    one = StateModel(compile(head, config))
    width = int(one.manifest.draft_head["hidden_size"])
    rng = np.random.default_rng(0)
    ids = rng.integers(0, one.vocab_size, args.context + 1)
    hidden = rng.standard_normal((args.context + 1, width)).astype(np.float32)

    def rows(n):  # what a call of n tokens reads: every row's hidden state, or the last one's
        return hidden[:n] if batch.each else hidden[n - 1:n]

    for s in slots:
        s.forward(ids[:args.context], rows(args.context))
    one.forward(ids[:args.context], rows(args.context))
    times: dict[str, list[float]] = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)

    def alone():
        one.forward(ids[args.context:], hidden[args.context:])
        one.commit(args.context)

    def batched(n):
        def run():
            for s in slots[:n]:  # hand in without a step (as tasks of a driver would), then one step for all
                s.pending, s.rows, s.fed, s.error = ids[args.context:], hidden[args.context:], 0, None
            with batch._cond:
                batch._step()
            for s in slots[:n]:
                s.commit(args.context)
        return run

    def catch_up_alone():
        one.reset()
        one.forward(ids[:args.context], rows(args.context))

    def catch_up_batched():
        slots[0].reset()
        slots[0].forward(ids[:args.context], rows(args.context))

    for _ in range(args.repeats):
        timed("one-sequence head, 1 row", alone)
        for n in sizes:
            timed(f"batched head, {n} x 1 row", batched(n))
    for _ in range(max(args.repeats // 20, 3)):
        timed(f"one-sequence head, {args.context} rows", catch_up_alone)
        timed(f"batched head, {args.context} rows", catch_up_batched)
    for s in slots[1:]:  # the catch-ups above left slot 0 as it was
        s.commit(args.context)
    print(f"{head}: {'attention' if batch.each else 'no attention'}, {args.threads} thread(s), context "
          f"{args.context}; medians in ms")
    for name, seconds in times.items():
        print(f"  {name:<34} {1000 * statistics.median(seconds):8.3f}")


if __name__ == "__main__":
    main()
