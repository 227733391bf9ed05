"""A batched step's time with ONNX Runtime's intra-op threads spinning within a run, and without.

    python scripts/spinning_ab.py [--target DIR] [--sequences 2] [--threads 2] [--gap-ms 1] [--steps 200]
                                  [--rounds 4] [--busy]

Each round runs two processes one after the other, one per setting (``Config.allow_spinning`` on and off;
both stop spinning when a run returns). Each makes a Batch of the target and times STEPS steps of SEQUENCES
sequences of one row, with GAP_MS of Python work in another thread before every step (what a server's rounds
do between steps). Prints the median step time of each setting over all rounds and their ratio. ``--busy``
keeps one core busy with another process meanwhile (a machine shared with other work).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time


def burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(args) -> list[float]:
    """Step times (seconds) of one Batch in this process."""
    from rlxrt import Config
    from rlxrt.sessions.batch import Batch

    config = Config(providers=("cpu",), intra_op_threads=args.threads, allow_spinning=args.spin == "on", cache=False)
    batch = Batch(args.target, config, slots=args.sequences, calibrate=False)
    for i in range(args.sequences):
        batch._seqs[i] = (i, 64, 1)
        batch._rows[i] = i
    times = []
    for step in range(args.steps + 20):  # the first 20 warm up
        if args.gap_ms:
            worker = threading.Thread(target=burn, args=(args.gap_ms / 1e3,))
            worker.start()
            worker.join()
        seconds = batch._run(args.sequences, args.sequences, args.sequences)
        if step >= 20:
            times.append(seconds)
    return times


def child(args, spin: str) -> list[float]:
    cmd = [sys.executable, __file__, "--spin", spin, "--target", args.target, "--sequences", str(args.sequences),
           "--threads", str(args.threads), "--gap-ms", str(args.gap_ms), "--steps", str(args.steps)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="model directory (default: the shipped reference target)")
    p.add_argument("--sequences", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gap-ms", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--busy", action="store_true")
    p.add_argument("--spin", choices=("on", "off"), help=argparse.SUPPRESS)  # one child process's setting
    args = p.parse_args()
    if args.target is None:
        from rlxrt.app.reference import reference_pair

        args.target = str(reference_pair()[0])
    if args.spin:
        print(json.dumps(measure(args)))
        return
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    times: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for r in range(args.rounds):
            for spin in (("on", "off") if r % 2 == 0 else ("off", "on")):
                times[spin] += child(args, spin)
    finally:
        if neighbour:
            neighbour.kill()
    on, off = (statistics.median(times[s]) * 1e3 for s in ("on", "off"))
    print(f"{args.sequences} sequences, {args.threads} threads, {args.gap_ms} ms gap"
          f"{', one core busy' if args.busy else ''}: spinning {on:.3f} ms, not spinning {off:.3f} ms, "
          f"ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
