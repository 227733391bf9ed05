"""rlxrt's CPU MatMul against ONNX Runtime's on the same graphs, side by side in one process.

    python scripts/kernels_ab.py TARGET [--draft DIR | --head DIR] [--k 4] [--chat] [--prompts 4]
                                [--tokens 64] [--repeats 3] [--threads 1] [--out FILE]

The target (and the draft or head, when given) is compiled twice, once with ``cpu_kernels = ort`` and once with
``cpu_kernels = rlxrt``; each repeat decodes the same prompts plainly and speculatively on both, in an order
that alternates per repeat. Printed: tokens a second relative to plain decoding on ONNX Runtime's MatMul
(medians over the repeats), whether every output equals plain greedy on the same kernel, whether the two
kernels' plain outputs are the same (float32: yes; int8 activations round differently, so not always), and the
step times T(n) of the target (logits and, with a greedy head, ids) over the text it wrote, interleaved.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

MODES = ("ort", "rlxrt")


def main() -> None:
    from rlxrt import Config
    from rlxrt.app.bench import step_times
    from rlxrt.app.smollm2 import BENCH_PROMPTS
    from rlxrt.backends import compile
    from rlxrt.backends.compile import cpu_model
    from rlxrt.sessions import DraftModel, MtpHead, Session

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target")
    ap.add_argument("--draft")
    ap.add_argument("--head")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--chat", action="store_true", help="send SmolLM2's bench prompts through the chat template")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args()
    rows: dict[str, Session] = {}
    states = {}
    for mode in MODES:
        cfg = Config(intra_op_threads=a.threads, cpu_kernels=mode)
        target = compile(a.target, cfg)
        target.huge_pages.wait()
        states[mode] = target.cpu_kernels
        rows[f"plain {mode}"] = Session(target)
        if a.draft or a.head:
            other = compile(a.draft or a.head, cfg)
            spec = DraftModel(other) if a.draft else MtpHead(other)
            rows[f"{'draft' if a.draft else 'mtp'} k={a.k} {mode}"] = Session(target, spec, k=a.k)
    first = rows["plain ort"]
    if a.chat:
        prompts = [first.chat_prompt([{"role": "user", "content": p}]) for p in BENCH_PROMPTS[:a.prompts]]
    else:
        from rlxrt.app.reference import reference_prompts

        prompts = reference_prompts()[:a.prompts]
    for s in rows.values():  # warm-up
        s.generate(prompts[0], max_new_tokens=8, ignore_eos=True)
    want = {mode: [rows[f"plain {mode}"].generate(p, max_new_tokens=a.tokens, ignore_eos=True).token_ids
                   for p in prompts] for mode in MODES}
    rates: dict[str, list[float]] = {n: [] for n in rows}
    same = {n: True for n in rows}
    names = list(rows)
    for rep in range(a.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            t0, n = time.perf_counter(), 0
            for p, w in zip(prompts, want[name.split()[-1]]):
                got = rows[name].generate(p, max_new_tokens=a.tokens, ignore_eos=True).token_ids
                same[name] &= got == w
                n += len(got)
            rates[name].append(n / (time.perf_counter() - t0))
    base = statistics.median(rates["plain ort"])
    last = first.last
    text = last.prompt_token_ids + last.token_ids
    steps: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(a.repeats):
        for mode in MODES:
            steps[mode].append(step_times(rows[f"plain {mode}"].target, None, sorted({2, 4, a.k}), context=len(text) - max(4, a.k) - 2,
                                          text=text, repeats=30))
    result = {"target": a.target.rstrip("/").split("/")[-1], "cpu": cpu_model(), "threads": a.threads,
              "cpu_kernels": states, "tok_per_s_vs_plain_ort": {n: round(statistics.median(r) / base, 3)
                                                              for n, r in rates.items()},
              "plain_ort_tok_per_s": round(base, 1), "equals_plain_greedy_on_the_same_kernel": same,
              "plain_outputs_equal_across_kernels": want["ort"] == want["rlxrt"], "step_ms": {}, "step_vs_t1": {}}
    for mode in MODES:
        med = {k: statistics.median(d[k] for d in steps[mode]) for k in steps[mode][0]}
        result["step_ms"][mode] = {k: round(v * 1e3, 3) for k, v in med.items()}
        result["step_vs_t1"][mode] = {k: round(v / med["target_1"], 3) for k, v in med.items()}
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
