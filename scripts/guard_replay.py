"""What a guard's rule costs against the better of its two modes, replayed on a server's own step times.

    python scripts/guard_replay.py record TRACE.json [--plain | --explore N] -- serve --engine batch ...
    python scripts/guard_replay.py replay PLAIN.json DRAFTING.json [--loads 2,5-8] [--budgets 0.01,0.005] \
        [--margins 0.03,0.06]

``record`` runs ``rlxrt serve`` with every ``k_policy.Guard.step`` logged (the load, the mode, seconds,
tokens) and writes them to TRACE.json when the server is stopped (SIGTERM or SIGINT); drive it with
``rlxrt bench-serve --external NAME=URL``. Run it twice: once with ``--explore 1`` (a guard tries the other mode
after every window in its better one, so both modes' steps are many) and once with
``--plain`` (every guard held in plain: one long timeline of plain steps, the machine's noise as the server
sees it, HTTP threads and the clients included).

``replay`` plays guards against that timeline: at step i the plain mode gives the timeline's step i, and
drafting gives the same step scaled so that drafting serves f times plain's tokens a second overall, with the
spread of real drafting steps (each drafting step's seconds over the median plain step's and its tokens a
sequence, drawn at random). Both modes see the machine as it was at step i, as they would if either ran then. It
prints, for each rule (a budget and a margin) and each f, the tokens a second the guard served over the better
mode's, over plain steps', and the share of steps it drafted: a guard that always knew the better mode would read
1.000 in the first throughout, and the goal (never slower than plain steps) is the second at 1.000 or above.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
from collections import defaultdict

FACTORS = (0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 1.4)


def record(out: str, plain: bool, explore: int | None, serve_args: list[str]) -> int:
    from rlxrt.sessions import batch as batching
    from rlxrt.sessions import k_policy

    steps: dict[str, dict[str, list]] = defaultdict(lambda: {"plain": [], "drafting": []})
    step, guard_of = k_policy.Guard.step, batching.Batch.guard

    def logged(self, drafting, seconds, tokens):
        if not (drafting == self.drafting and self._settling > 0):  # the steps the guard counts
            steps[self.load]["drafting" if drafting else "plain"].append((round(seconds * 1e6), tokens))
        return step(self, drafting, seconds, tokens)

    def guard(self, sequences):
        g = guard_of(self, sequences)
        if not hasattr(g, "load"):
            g.load = batching.load_label(batching._load(sequences))
            if plain:
                g.drafting, g._switch = False, lambda drafting, phase: None
            if explore:
                g.explore = g.explore_min = g.explore_max = g.explore_far = explore
        return g

    k_policy.Guard.step, batching.Batch.guard = logged, guard
    from rlxrt.app.cli import main

    def stop(signum, frame):  # uvicorn raises the signal again once it has shut down
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        return main(serve_args)  # until the server is stopped (SIGTERM or SIGINT)
    finally:
        with open(out, "w") as fh:
            json.dump({"held_plain": plain, "explore": explore, "steps": steps}, fh)


def mixed(timeline, drafts, plain_ref, f: float, seed: int):
    """The drafting mode's steps on the plain timeline, scaled to f times its rate (see the module's text)."""
    rng = random.Random(seed)
    median, sequences = statistics.median(s for s, _ in plain_ref), plain_ref[0][1]
    spread = [(s / median, t / sequences) for s, t in drafts]
    picks = [spread[rng.randrange(len(spread))] for _ in timeline]
    seconds = [s * a for (s, _), (a, _) in zip(timeline, picks)]
    tokens = [n * b for (_, n), (_, b) in zip(timeline, picks)]
    rate = sum(t for _, t in timeline) / sum(s for s, _ in timeline)
    scale = f * rate / (sum(tokens) / sum(seconds))
    return list(zip(seconds, [t * scale for t in tokens])), rate


def served(guard, timeline, drafting_steps) -> tuple[float, float]:
    """The guard's tokens a second over the timeline, and the share of its steps that drafted."""
    tokens = seconds = drafted = 0.0
    for plain_step, drafting_step in zip(timeline, drafting_steps):
        s, t = drafting_step if guard.drafting else plain_step
        drafted += guard.drafting
        guard.step(guard.drafting, s, t)
        tokens, seconds = tokens + t, seconds + s
    return tokens / seconds, drafted / len(timeline)


def replay(args) -> int:
    from rlxrt.sessions.k_policy import Guard

    plain_trace, drafting_trace = (_load(p)["steps"] for p in (args.plain_trace, args.drafting_trace))
    rules = {f"budget {b}, margin {m}": (lambda b=b, m=m: Guard(budget=b, margin=m))
             for b in map(float, args.budgets.split(",")) for m in map(float, args.margins.split(","))}
    for load in args.loads.split(","):
        drafts, plain_ref = drafting_trace[load]["drafting"], drafting_trace[load]["plain"]
        timeline = [(us / 1e6, n) for us, n in plain_trace[load]["plain"]]
        drafts, plain_ref = [(us / 1e6, n) for us, n in drafts], [(us / 1e6, n) for us, n in plain_ref]
        print(f"\n{load} sequences: {len(timeline)} plain steps, {sum(s for s, _ in timeline):.1f} s; "
              f"{len(drafts)} drafting steps for their spread")
        print("| rule | " + " | ".join(f"f={f}" for f in FACTORS) + " |")
        print("| --- |" + " --- |" * len(FACTORS))
        for name, make in rules.items():
            cells = []
            for f in FACTORS:
                got, plain, shares = [], [], []
                for seed in range(args.seeds):
                    start = seed * 997 % len(timeline)  # each seed starts the timeline somewhere else
                    turned = timeline[start:] + timeline[:start]
                    drafting, rate = mixed(turned, drafts, plain_ref, f, seed)
                    r, share = served(make(), turned, drafting)
                    got.append(r / (rate * max(1.0, f)))
                    plain.append(r / rate)
                    shares.append(share)
                cells.append(f"{statistics.fmean(got):.3f} / {statistics.fmean(plain):.3f} / "
                             f"{statistics.fmean(shares):.2f}")
            print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


def _load(path: str) -> dict:
    import gzip

    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as fh:
        return json.load(fh)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "record":
        p = argparse.ArgumentParser(prog="guard_replay.py record")
        p.add_argument("out")
        p.add_argument("--plain", action="store_true", help="hold every guard in plain")
        p.add_argument("--explore", type=int, help="windows in the better mode before each try")
        argv = sys.argv[2:]
        cut = argv.index("--") if "--" in argv else len(argv)
        a = p.parse_args(argv[:cut])
        return record(a.out, a.plain, a.explore, argv[cut + 1:])
    p = argparse.ArgumentParser(prog="guard_replay.py replay")
    p.add_argument("command", choices=["replay"])
    p.add_argument("plain_trace", help="a trace recorded with --plain: the timeline")
    p.add_argument("drafting_trace", help="a trace recorded as the guards ship: the drafting steps' spread")
    p.add_argument("--loads", default="2,5-8", help="the guards' loads to replay (labels as Batch.guards)")
    p.add_argument("--seeds", type=int, default=12)
    p.add_argument("--budgets", default="0.005", help="Guard budgets to compare")
    p.add_argument("--margins", default="0.03,0.06", help="Guard margins to compare")
    return replay(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
