"""What an fp32 MatMul costs for M rows relative to one, with weights streamed from memory or cache-resident.

    python scripts/rows_cost.py [--layers 24] [--k 576] [--n 3072] [--repeats 5]

A chain of LAYERS distinct K x N weights (SmolLM2's MLP shape: 170 MB at the defaults, far beyond the
caches) is what a decoder step reads; a single K x N weight run again and again stays in the caches. ONNX
Runtime's CPU MatMul (MLAS, prepacked weights, 1 intra-op thread) is timed for M = 1 … 8 rows, interleaved,
and printed as medians relative to M = 1. This is why T(k+1)/T(1) of an fp32 verification is what it is on
a given CPU: nothing in the graph changes it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def session(weights: list[np.ndarray]):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k = weights[0].shape[0]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(len(weights))]
    graph = helper.make_graph(nodes, "rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None)
                               for i in range(len(weights))],
                              [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    streamed = session([rng.standard_normal((a.k, a.n), dtype=np.float32) * 0.02 for _ in range(a.layers)])
    cached = session([rng.standard_normal((a.k, a.n), dtype=np.float32) * 0.02])
    rows = range(1, 9)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(a.repeats):
        for name, sess, calls in (("streamed", streamed, 5), ("cached", cached, 5 * a.layers)):
            for m in rows:
                x = rng.standard_normal((m, a.k), dtype=np.float32)
                sess.run(None, {"x": x})
                t0 = time.perf_counter()
                for _ in range(calls):
                    sess.run(None, {"x": x})
                times.setdefault((name, m), []).append(time.perf_counter() - t0)
    mb = a.layers * a.k * a.n * 4 / 1e6
    for name, label in (("streamed", f"{a.layers} distinct weights, {mb:.0f} MB"), ("cached", "one weight, cached")):
        base = statistics.median(times[(name, 1)])
        print(f"{label:>32}: " + "  ".join(f"M={m} {statistics.median(times[(name, m)]) / base:.2f}x" for m in rows))


if __name__ == "__main__":
    main()
