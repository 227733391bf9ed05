"""ORT sessions of the same graph in one process, decoding the same requests in turn: per-step time by load
order and page size. ``python scripts/load_order.py [TARGET_DIR] [PAGES]``: TARGET_DIR defaults to the SmolLM2
recipe's target; PAGES lists one session per entry in load order, ``huge`` (the default: weights moved onto
huge pages) or ``small`` (4 KiB pages), e.g. ``small,huge,small,huge``; default ``huge,huge,huge``."""
import os
import sys
import time

import numpy as np

from rlxrt.app.reference import reference_prompts
from rlxrt.backends import compile
from rlxrt.config import Config
from rlxrt.sessions import Session

target = os.path.expanduser(sys.argv[1] if len(sys.argv) > 1 else "~/.cache/rlxrt/smollm2/target")
pages = (sys.argv[2] if len(sys.argv) > 2 else "huge,huge,huge").split(",")
graphs = [compile(target, Config(providers=("cpu",), intra_op_threads=1, cache=False, huge_pages=p == "huge"))
          for p in pages]
states = [g.huge_pages.wait() for g in graphs]
sessions = [Session(g) for g in graphs]
prompts = reference_prompts()[:4]
for s in sessions:
    s.generate(prompts[0], max_new_tokens=8, ignore_eos=True)
times: dict = {}
for _ in range(2):
    for q in prompts:
        for i, s in enumerate(sessions):
            for n in (1, 65):  # the prefill alone, then the prefill and 64 steps
                t0 = time.perf_counter()
                s.generate(q, max_new_tokens=n, ignore_eos=True)
                times.setdefault((i, n), []).append(time.perf_counter() - t0)
m = {k: np.median(v) * 1e3 for k, v in times.items()}
for i in range(len(sessions)):
    print(f"session {i} ({states[i]}): prefill {m[(i, 1)]:.1f} ms, step {(m[(i, 65)] - m[(i, 1)]) / 64:.2f} ms")
