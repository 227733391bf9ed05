"""Two builds of rlxrt's kernel library on one attention op alone, side by side in one process.

    python scripts/attention_ab.py OLD.so NEW.so [--heads 9,3,64] [--capacity 2048] [--rows 1,4,8]
                                   [--contexts 16,300,1000] [--layers 24] [--repeats 15] [--threads 1]

For an attention change (backends/stream_attention.h): keep a copy of the library before it, rebuild
(``python setup.py build_ext --inplace --force``), and pass both. One GroupQueryAttention node as rlxrt's fused
graphs write it (query heads, kv heads, head size: SmolLM2-135M's by default), rewritten to StreamAttention and
loaded once per library; each library runs it over ``--layers`` KV buffers of its own in turn, as a step's
layers do, so that the keys and values come from memory, not from a cache that one buffer would fit. Each
repeat times one pass over the layers on one library, then on the other (the order alternating); printed are
the medians (microseconds a call) and new / old. Calling the same library twice shows what the order alone
does on this machine.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def attention_graph(heads: int, kv_heads: int, head_dim: int, capacity: int):
    """One packed-qkv GroupQueryAttention node with rotary inside and a KV buffer of ``capacity`` positions."""
    from onnx import TensorProto as T, helper, numpy_helper

    angles = np.outer(np.arange(capacity), 1 / 10000 ** (np.arange(0, head_dim, 2) / head_dim))
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "pk", "pv", "seqlens_k", "total", "cos", "sin"],
                            ["out", "prk", "prv"], domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads,
                            scale=head_dim ** -0.5, do_rotary=1, rotary_interleaved=0, local_window_size=-1)
    inputs = [helper.make_tensor_value_info("qkv", T.FLOAT, [1, "s", (heads + 2 * kv_heads) * head_dim])] + [
        helper.make_tensor_value_info(n, T.FLOAT, [1, kv_heads, capacity, head_dim]) for n in ("pk", "pv")] + [
        helper.make_tensor_value_info("seqlens_k", T.INT32, [1]), helper.make_tensor_value_info("total", T.INT32, [])]
    outputs = [helper.make_tensor_value_info(n, T.FLOAT, None) for n in ("out", "prk", "prv")]
    tables = [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
              numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")]
    graph = helper.make_graph([node], "attention", inputs, outputs, tables)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def main() -> None:
    import onnxruntime as ort

    from rlxrt.backends import cpu_kernels

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head size")
    p.add_argument("--capacity", type=int, default=2048)
    p.add_argument("--rows", default="1,4,8", help="new tokens a call")
    p.add_argument("--contexts", default="16,300,1000")
    p.add_argument("--layers", type=int, default=24, help="KV buffers each library runs in turn")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    heads, kv_heads, head_dim = (int(x) for x in a.heads.split(","))
    model = attention_graph(heads, kv_heads, head_dim, a.capacity)
    cpu_kernels.rewrite(model, cpu_kernels.plan(model, "rlxrt", "cpu"))
    rng = np.random.default_rng(0)
    runs = []
    for library in (a.old, a.new):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = a.threads
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.register_custom_ops_library(library)
        s = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        shape = (1, kv_heads, a.capacity, head_dim)
        buffers = [ort.OrtValue.ortvalue_from_numpy(rng.standard_normal(shape).astype(np.float32))
                   for _ in range(2 * a.layers)]
        runs.append((s, buffers))

    def bindings(s, buffers, rows: int, context: int) -> list:
        x = rng.standard_normal((1, rows, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
        made = []
        for layer in range(a.layers):
            b = s.io_binding()
            b.bind_cpu_input("qkv", x)
            b.bind_cpu_input("seqlens_k", np.array([context + rows - 1], np.int32))
            b.bind_cpu_input("total", np.array(context + rows, np.int32))
            for past, present, buf in (("pk", "prk", buffers[2 * layer]), ("pv", "prv", buffers[2 * layer + 1])):
                b.bind_ortvalue_input(past, buf)
                b.bind_ortvalue_output(present, buf)
            b.bind_output("out")
            made.append(b)
        return made

    for rows in (int(x) for x in a.rows.split(",")):
        for context in (int(x) for x in a.contexts.split(",")):
            made = [bindings(s, buffers, rows, context) for s, buffers in runs]
            times: list[list[float]] = [[], []]
            for repeat in range(a.repeats + 2):
                for i in ((0, 1) if repeat % 2 else (1, 0)):
                    s = runs[i][0]
                    t0 = time.perf_counter()
                    for b in made[i]:
                        s.run_with_iobinding(b)
                    if repeat >= 2:  # two passes warm up
                        times[i].append((time.perf_counter() - t0) / a.layers)
            old, new = (statistics.median(t) * 1e6 for t in times)
            print(f"{rows} rows, context {context:5d}: old {old:8.1f} us, new {new:8.1f} us, new/old {new / old:.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
