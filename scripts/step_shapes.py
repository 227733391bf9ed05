"""What a batched step costs by its shape: sequences x rows each, at a context, against what the k plan reads.

    python scripts/step_shapes.py [--target DIR] [--contexts 0,256,512] [--shapes 1x1,2x1,2x4] [--repeats 5]

The target's batched graph (default: the shipped target) runs steps of S sequences of r rows each, every one
at the same context (tokens already in its KV slot), in turn and repeated; medians in ms. Then the step cost
the Batch measured at start-up (``StepCost``: its shape, what a row adds a token of context) for the same
rows and context, so the two can be compared: what the plan reads for a step against what the step takes.
"""
from __future__ import annotations

import argparse
import statistics

SHAPES = ((1, 1), (1, 8), (1, 16), (2, 1), (2, 3), (8, 1), (8, 2), (8, 3), (16, 1), (16, 2))


def step(batch, sequences: int, rows: int, context: int) -> float:
    total = 0
    for n in range(sequences):
        batch._seqs[n] = (n, context, rows)
        batch._rows[n] = total + rows - 1
        total += rows
    batch._ids[0, :total] = 1
    return batch._run(total, sequences, sequences)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--contexts", default="0,256,512")
    ap.add_argument("--shapes", default=",".join(f"{s}x{r}" for s, r in SHAPES), help="SEQUENCESxROWS, ...")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    try:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in a.shapes.split(",")]
    except ValueError:
        raise SystemExit(f"--shapes takes SEQUENCESxROWS pairs such as 1x1,2x4; got {a.shapes!r}") from None
    if any(len(shape) != 2 or min(shape) < 1 or shape[0] > 16 for shape in shapes):
        raise SystemExit(f"--shapes: each is SEQUENCESxROWS with 1 <= SEQUENCES <= 16 and ROWS >= 1; got {a.shapes!r}")
    import rlxrt
    from rlxrt.app.reference import reference_pair
    from rlxrt.sessions import Batch

    batch = Batch(a.target or reference_pair()[0], rlxrt.Config(intra_op_threads=2, cpu_kernels="rlxrt"),
                  slots=16)
    contexts = [c for c in (int(x) for x in a.contexts.split(",")) if c + 16 < batch.capacity]
    times: dict[tuple[int, int, int], list[float]] = {}
    for repeat in range(a.repeats + 1):
        for s, r in shapes:
            for c in contexts:
                seconds = step(batch, s, r, c)
                if repeat:  # the first pass warms up
                    times.setdefault((s, r, c), []).append(seconds)
    cost = batch.cost
    print(f"per row and token of context: {cost.per_row_context * 1e6:.3f} us")
    print("| sequences x rows | " + " | ".join(f"c={c} step / plan (ms)" for c in contexts) + " |")
    print("| --- |" + " --- |" * len(contexts))
    for s, r in shapes:
        cells = [f"{statistics.median(times[(s, r, c)]) * 1e3:.2f} / {cost(s * r, c) * 1e3:.2f}" for c in contexts]
        print(f"| {s} x {r} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
