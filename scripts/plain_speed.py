"""Plain greedy chat decoding speed of several exports of one model, side by side, relative to the first.

    python scripts/plain_speed.py FIRST OTHER... [--prompts 4] [--tokens 64] [--repeats 3]

Each repeat decodes the same chat prompts (SmolLM2's bench prompts) on every export in turn, 1 thread;
the ratios are medians over the repeats of tokens a second, each against the first export's. Used for the
int4 exports of a GGUF in docs/models.md (float32, the file's blocks, re-quantised).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from rlxrt import Config
from rlxrt.app.smollm2 import BENCH_PROMPTS
from rlxrt.sessions import Session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    sessions = [Session(m, None, Config(intra_op_threads=1)) for m in a.models]
    chats = [[{"role": "user", "content": p}] for p in BENCH_PROMPTS[:a.prompts]]
    for s in sessions:  # warm-up
        s.chat(chats[0], max_new_tokens=8)
    rates: dict[str, list[float]] = {m: [] for m in a.models}
    for _ in range(a.repeats):
        for m, s in zip(a.models, sessions):
            t0 = time.perf_counter()
            n = sum(len(s.chat(c, max_new_tokens=a.tokens, ignore_eos=True).token_ids) for c in chats)
            rates[m].append(n / (time.perf_counter() - t0))
    base = statistics.median(rates[a.models[0]])
    print(json.dumps({m: round(statistics.median(r) / base, 3) for m, r in rates.items()}, indent=1))


if __name__ == "__main__":
    main()
