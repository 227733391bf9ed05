"""Where a batch engine's driver thread spends its time: target steps, draft steps and the Python between them.

    python scripts/driver_time.py OUT.json [--guard free|drafting|plain] -- serve --engine batch ...

runs ``rlxrt serve`` with every ONNX Runtime call of a Batch timed (``Batch._run``) and, when the server is
stopped (SIGTERM or SIGINT), writes to OUT.json, for each shape of target step (its sequences and rows) seen 20
times or more: the median target run, the Python on the driver's thread before it (from the last call's end),
the draft steps in its gap (how many, their time, the first's and the second's apart); and the totals of
each kind over the run; and each speculator's proposals (calls, tokens, milliseconds a call and a token, a draft
Batch's steps within them). ``--guard drafting`` holds every guard drafting (the plan still chooses the ks),
``plain`` holds them in plain. Drive the server with ``rlxrt bench-serve --external NAME=URL``. The first draft
step of a round against the second is what showed the event loop's wait (docs/performance.md, "Stop 66").
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from collections import defaultdict

K_MAX = 8
"""Rows a sequence of a verification step may hold beyond one, for the totals' kinds."""
IDLE = 0.05
"""A gap longer than this (seconds) is the driver waiting for requests, not Python."""


def install(guard_mode: str, events: list, proposals: dict) -> None:
    from rlxrt.sessions import DraftModel, MtpHead, PromptLookup
    from rlxrt.sessions import batch as batching

    guard_of, run = batching.Batch.guard, batching.Batch._run
    mark = [None]

    def guard(self, sequences):
        g = guard_of(self, sequences)
        if guard_mode != "free" and not getattr(g, "_held", False):
            g._held, g.drafting = True, guard_mode == "drafting"
            g._switch = lambda drafting, phase: None
        return g

    def timed(self, tokens, sequences, rows):
        t0 = time.perf_counter()
        before = t0 - mark[0] if mark[0] is not None else 0.0
        seconds = run(self, tokens, sequences, rows)
        if any(s.pending is not None for s in self._all):  # not the start-up's calibration
            events.append(("draft" if self.drafts_only() else "target", before, time.perf_counter() - t0, tokens,
                           sequences))
        mark[0] = time.perf_counter()
        return seconds

    batching.Batch.guard, batching.Batch._run = guard, timed
    for cls in (DraftModel, MtpHead, PromptLookup):
        cls.propose = _timed_propose(cls.propose, proposals.setdefault(cls.__name__, [0, 0, 0.0]))


def _timed_propose(propose, record: list):
    """``propose`` counting its calls, the tokens it proposed and its seconds (a draft Batch's steps in them)."""
    def timed(self, ctx, k):
        t0 = time.perf_counter()
        out = propose(self, ctx, k)
        record[0] += 1
        record[1] += len(out.tokens)
        record[2] += time.perf_counter() - t0
        return out
    return timed


def gaps(events: list) -> list[dict]:
    """Each target step with what ran on the driver's thread since the one before it."""
    out, python, drafts = [], 0.0, []
    for kind, before, run, tokens, sequences in events:
        idle = before > IDLE
        python += 0.0 if idle else before
        if kind == "draft":
            drafts.append(run)
            continue
        out.append({"sequences": sequences, "rows": tokens, "run": run, "python": python, "drafts": drafts,
                    "idle": idle})
        python, drafts = 0.0, []
    return out


def shapes(steps: list[dict], least: int = 20) -> list[dict]:
    by = defaultdict(list)
    for s in steps:
        if not s["idle"]:
            by[(s["sequences"], s["rows"])].append(s)
    ms = lambda values: round(statistics.median(values) * 1e3, 3) if values else None
    return [{"sequences": seq, "rows": rows, "steps": len(ss), "target_ms": ms([s["run"] for s in ss]),
             "python_ms": ms([s["python"] for s in ss]),
             "draft_steps": round(statistics.fmean(len(s["drafts"]) for s in ss), 2),
             "drafts_ms": ms([sum(s["drafts"]) for s in ss]),
             "first_draft_ms": ms([s["drafts"][0] for s in ss if s["drafts"]]),
             "second_draft_ms": ms([s["drafts"][1] for s in ss if len(s["drafts"]) > 1])}
            for (seq, rows), ss in sorted(by.items()) if len(ss) >= least]


def totals(steps: list[dict]) -> dict:
    """Seconds of each kind of target step (decode: a row a sequence; verify: drafted rows; prompt: more),
    of the Python and the draft steps before them."""
    out: dict[str, float] = defaultdict(float)
    for s in steps:
        kind = "decode" if s["rows"] == s["sequences"] else \
            "verify" if s["rows"] <= s["sequences"] * (K_MAX + 1) else "prompt"
        out[f"{kind}_steps"] += 1
        out[f"{kind}_target_s"] += s["run"]
        out[f"{kind}_python_s"] += s["python"]
        out[f"{kind}_drafts_s"] += sum(s["drafts"])
    return {k: round(v, 3) for k, v in sorted(out.items())}


def main() -> int:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="driver_time.py")
    p.add_argument("out")
    p.add_argument("--guard", choices=("free", "drafting", "plain"), default="free")
    args = p.parse_args(argv[:cut])
    events: list = []
    proposals: dict = {}
    install(args.guard, events, proposals)
    from rlxrt.app.cli import main as cli

    def stop(signum, frame):  # uvicorn raises the signal again once it has shut down
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        return cli(argv[cut + 1:])
    finally:
        steps = gaps(events)
        with open(args.out, "w") as fh:
            json.dump({"guard": args.guard, "shapes": shapes(steps), "totals": totals(steps),
                       "proposals": {name: {"calls": c, "tokens": t, "ms_a_call": round(sec / c * 1e3, 3) if c else None,
                                            "ms_a_token": round(sec / t * 1e3, 3) if t else None}
                                     for name, (c, t, sec) in proposals.items()}}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
