"""OpenVINO GenAI's ContinuousBatchingPipeline on N prompts (token ids) at once: tokens/s, as JSON on stdout.

Runs in a venv of its own (openvino-genai, optimum-intel), driven by scripts/batch_vs_openvino.py:

    python scripts/openvino_cb.py OV_MODEL_DIR PROMPT_IDS.json --max-tokens 64 --precision f32 --repeats 1

The model directory is `optimum-cli export openvino --model HF_DIR --weight-format fp32|int4 OUT`. Greedy,
EOS ignored, every prompt submitted at once; ``--precision`` sets INFERENCE_PRECISION_HINT (f32: true fp32
arithmetic; bf16: OpenVINO's default on CPUs that have it) and ``--kv-precision`` KV_CACHE_PRECISION (OpenVINO's
CPU default is u8: the KV cache quantised to 8 bits whatever the inference precision; f32 for a true fp32
comparison).
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--precision", default="f32")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--kv-precision", default="", help="KV_CACHE_PRECISION (default: OpenVINO's, u8 on CPU)")
    args = p.parse_args()
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    prompts = [ov.Tensor(np.asarray([ids], np.int64)) for ids in json.load(open(args.prompts))]
    sched = ov_genai.SchedulerConfig()
    sched.cache_size = 2
    sched.max_num_seqs = max(len(prompts), 1)
    props = {"INFERENCE_PRECISION_HINT": args.precision}
    if args.kv_precision:
        props["KV_CACHE_PRECISION"] = args.kv_precision
    if args.threads:
        props["INFERENCE_NUM_THREADS"] = args.threads
    pipe = ov_genai.ContinuousBatchingPipeline(args.model, sched, "CPU", props)
    config = ov_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos, config.do_sample = args.max_tokens, True, False
    pipe.generate(prompts[:2], [config] * 2)  # warm-up
    runs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        results = pipe.generate(prompts, [config] * len(prompts))
        wall = time.perf_counter() - t0
        tokens = sum(len(r.m_generation_ids[0]) for r in results)
        runs.append({"tokens": tokens, "seconds": wall, "tokens_per_second": tokens / wall})
    print(json.dumps({"engine": "openvino-genai continuous batching", "precision": args.precision,
                      "kv_precision": args.kv_precision or "default",
                      "version": ov_genai.__version__, "runs": runs}))


if __name__ == "__main__":
    main()
