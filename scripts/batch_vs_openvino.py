"""rlxrt's batched step against OpenVINO GenAI's continuous batching, side by side in one run.

N requests (the same prompt token ids, greedy, EOS ignored) submitted at once to: rlxrt's Batch (N Sessions
on N slots, plain and with a speculator when --head is given), rlxrt one request after another (what a
one-worker server does), and OpenVINO GenAI's ContinuousBatchingPipeline (scripts/openvino_cb.py, run in the
venv given by --ov-python), once per KV cache precision in --ov-kv (OpenVINO's CPU default quantises its KV cache
to u8 whatever INFERENCE_PRECISION_HINT says; rlxrt's is float32). Repeats interleave the engines; medians of
tokens/s are reported, as JSON and a table. Everything runs in-process (no HTTP) on the same cores.

    python scripts/batch_vs_openvino.py --target DIR --ov-model OV_DIR --ov-python /path/to/ovenv/bin/python \\
        --precision f32 --requests 8 --max-tokens 64 --repeats 3 [--head HEAD_DIR -k 3] --out results/batch-openvino
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median


def at_once(n: int, one) -> float:
    """``one(i)`` for i < n, all at once, each a task of one Driver on this thread (as the server runs its
    batch's requests): the wall time."""
    from rlxrt.sessions import Driver

    driver = Driver()
    try:
        for i in range(n):
            driver.spawn(one, i)
        t0 = time.perf_counter()
        driver.run()
        return time.perf_counter() - t0
    finally:
        driver.close()


def generate_at_once(sessions, prompts, max_tokens) -> tuple[list, float]:
    """Each Session (on a Batch) generates for its prompt, all at once (``at_once``): (the Generations, the wall
    time)."""
    out: list = [None] * len(prompts)

    def one(i):
        out[i] = sessions[i].generate(prompts[i], max_new_tokens=max_tokens, ignore_eos=True)

    return out, at_once(len(prompts), one)


def rlxrt_batch(batch, make_spec, config, prompts, max_tokens, k=None) -> float:
    from rlxrt.sessions import Session

    sessions = [Session(batch, make_spec(), config, **({"k": k} if k else {})) for _ in prompts]
    out, wall = generate_at_once(sessions, prompts, max_tokens)
    del sessions
    return sum(len(g.token_ids) for g in out) / wall


def rlxrt_sequential(session, prompts, max_tokens) -> float:
    t0, tokens = time.perf_counter(), 0
    for p in prompts:
        tokens += len(session.generate(p, max_new_tokens=max_tokens, ignore_eos=True).token_ids)
    return tokens / (time.perf_counter() - t0)


def openvino(args, ids_file: str, kv: str) -> float:
    out = subprocess.run([args.ov_python, str(Path(__file__).with_name("openvino_cb.py")), args.ov_model, ids_file,
                          "--max-tokens", str(args.max_tokens), "--precision", args.precision,
                          *(["--kv-precision", kv] if kv != "default" else [])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["runs"][0]["tokens_per_second"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--head")
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--ov-model", required=True)
    p.add_argument("--ov-python", required=True)
    p.add_argument("--precision", default="f32")
    p.add_argument("--ov-kv", default="f32,default",
                   help="OpenVINO KV cache precisions to run, one engine each (default is its own: u8 on CPU)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default="results/batch-openvino")
    args = p.parse_args()
    import gc

    import rlxrt
    from rlxrt.app.flags import prompts_of
    from rlxrt.sessions import Batch, MtpHead, Session

    config = rlxrt.Config(intra_op_threads=args.threads, cpu_kernels="rlxrt")
    one_thread = rlxrt.Config(intra_op_threads=1, cpu_kernels="rlxrt")
    lone = Session(args.target, None, config)
    texts = prompts_of(argparse.Namespace(prompt_file=None), args.requests)[:args.requests]
    prompts = [lone.prompt_ids(t) for t in texts]
    batch = Batch(args.target, config, slots=args.requests)
    ids = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(prompts, ids)
    ids.close()
    engines = {"rlxrt batch plain": lambda: rlxrt_batch(batch, lambda: None, config, prompts, args.max_tokens),
               "rlxrt one after another": lambda: rlxrt_sequential(lone, prompts, args.max_tokens)}
    for kv in args.ov_kv.split(","):
        engines[f"openvino-genai CB ({args.precision}, KV {kv})"] = lambda kv=kv: openvino(args, ids.name, kv)
    if args.head:
        engines[f"rlxrt batch mtp k={args.k}"] = lambda: rlxrt_batch(
            batch, lambda: MtpHead(args.head, one_thread), config, prompts, args.max_tokens, args.k)
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(args.repeats):
        order = list(engines.items()) if rep % 2 == 0 else list(reversed(engines.items()))
        for name, run in order:
            gc.collect()
            runs[name].append(run())
            print(f"  repeat {rep + 1}/{args.repeats} {name:<32} {runs[name][-1]:8.1f} tok/s", file=sys.stderr)
    os.unlink(ids.name)
    rows = {name: round(median(v), 2) for name, v in runs.items()}
    base = rows["rlxrt one after another"]
    report = {"target": Path(args.target).name, "ov_model": Path(args.ov_model).name, "precision": args.precision,
              "requests": args.requests, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "threads": args.threads, "cpu_count": os.cpu_count(), "tokens_per_second": rows, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{Path(args.target).name}-{args.precision}.json").write_text(json.dumps(report, indent=2) + "\n")
    print("| engine | tok/s | vs rlxrt one after another |\n| --- | --- | --- |")
    for name, v in rows.items():
        print(f"| {name} | {v:.1f} | {v / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
