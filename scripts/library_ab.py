"""Two builds of rlxrt's kernel library on the same compiled graph, side by side in one process.

    python scripts/library_ab.py MODEL_DIR OLD.so NEW.so [--contexts 8,180,900] [--rows 1,5] [--repeats 15]
                                 [--threads 1] [--calls 40]

For a kernel change: keep a copy of the library before it (``backends/_stream_matmul*.so``), rebuild
(``python setup.py build_ext --inplace --force``), and pass both. MODEL_DIR is a fused graph; it is compiled once
with rlxrt's kernels (``cpu_kernels = rlxrt``), and that rewritten graph is loaded into two sessions, one per
library, each with its own KV buffers. For each context length and row count, each repeat times ``--calls`` calls
on one library and then on the other; printed are the medians (microseconds a call) and new / old. The two
sessions can differ by themselves (where their memory lies, which was made first): pass the same library twice
to see by how much on this machine before reading a small new / old (docs/kernels.md, stop 54).
"""
from __future__ import annotations

import argparse
import time


def sessions(model: str, libraries: list[str], threads: int = 1):
    import numpy as np
    import onnxruntime as ort

    from rlxrt import Config
    from rlxrt.backends import compile

    g = compile(model, Config(intra_op_threads=1, cpu_kernels="rlxrt"))
    if g.cache_path is None or not g.cpu_kernels.startswith("on"):
        raise SystemExit(f"{model}: needs the compile cache and rlxrt's kernels ({g.cpu_kernels}; cache {g.cache})")
    kv, made = g.manifest.kv_cache, []
    for library in libraries:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the cache's graph is optimised
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.register_custom_ops_library(library)
        s = ort.InferenceSession(str(g.cache_path / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        binding, buffers = s.io_binding(), []
        for i in range(kv.layers):
            past_k, past_v, present_k, present_v = kv.names(i)
            for past, present in ((past_k, present_k), (past_v, present_v)):
                buf = ort.OrtValue.ortvalue_from_shape_and_type([1, kv.kv_heads, kv.capacity, kv.head_dim],
                                                                np.float32, "cpu", 0)
                binding.bind_ortvalue_input(past, buf)
                binding.bind_ortvalue_output(present, buf)
                buffers.append(buf)
        made.append((s, binding, buffers))
    return g.manifest, made


def main() -> None:
    import numpy as np

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--contexts", default="8,180,900")
    p.add_argument("--rows", default="1,5")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of both sessions")
    p.add_argument("--calls", type=int, default=40, help="calls a repeat times on each library")
    a = p.parse_args()
    manifest, made = sessions(a.model, [a.old, a.new], a.threads)
    inputs = manifest.inputs

    def prepare(s, binding, rows: int, context: int) -> None:
        feeds = {inputs["input_ids"]: np.ones((1, rows), np.int64),
                 inputs["seqlens_k"]: np.array([context + rows - 1], np.int32),
                 inputs["total_sequence_length"]: np.array(context + rows, np.int32),
                 inputs["num_logits"]: np.array([rows], np.int64)}
        if inputs.get("greedy"):
            feeds[inputs["greedy"]] = np.array([False])
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        kv_outputs = {n for i in range(manifest.kv_cache.layers) for n in manifest.kv_cache.names(i)}
        for o in s.get_outputs():
            if o.name not in kv_outputs:
                binding.bind_output(o.name, "cpu")
        s.run_with_iobinding(binding)

    for context in (int(x) for x in a.contexts.split(",")):
        for rows in (int(x) for x in a.rows.split(",")):
            times: list[list[float]] = [[], []]
            for _ in range(a.repeats):
                for which, (s, binding, _) in enumerate(made):
                    prepare(s, binding, rows, context)
                    start = time.perf_counter()
                    for _ in range(a.calls):
                        s.run_with_iobinding(binding)
                    times[which].append((time.perf_counter() - start) / a.calls * 1e6)
            old, new = (float(np.median(t)) for t in times)
            print(f"context {context:5d}, {rows} rows: old {old:8.1f} us, new {new:8.1f} us, new/old {new / old:.3f}")


if __name__ == "__main__":
    main()
