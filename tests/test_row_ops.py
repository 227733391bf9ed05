"""rlxrt's row-wise ops (backends/stream_rows.h, backends/fuse_rows.py): StreamNorm, StreamSkipNorm and
StreamSwiGLU against float64 numpy in each variant this CPU runs, a row the same alone or among others (on the
calling thread and shared out), special values, typed errors, and the rewrite that puts them in a graph (what
it takes, what it leaves, the same outputs as ONNX Runtime's nodes)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rlxrt.backends import cpu_kernels, fuse_rows

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="the kernel library was not built")
WIDTHS = (576, 100, 16, 7)
"""K: a multiple of 16 (SmolLM2's), and widths whose last columns go through a padded vector."""


def op_model(op: str, k: int, epsilon: float = 1e-5):
    """One of the row ops alone; inputs x, skip/up (and gamma for the norms), outputs y (and sum)."""
    from onnx import TensorProto as T, helper

    ins = {"StreamNorm": ["x", "gamma"], "StreamSkipNorm": ["x", "skip", "gamma"], "StreamSwiGLU": ["x", "up"]}[op]
    outs = ["y", "sum"] if op == "StreamSkipNorm" else ["y"]
    attrs = {} if op == "StreamSwiGLU" else {"epsilon": epsilon}
    node = helper.make_node(op, ins, outs, domain=cpu_kernels.DOMAIN, **attrs)
    inputs = [helper.make_tensor_value_info(n, T.FLOAT, ["k"] if n == "gamma" else [1, "s", k]) for n in ins]
    graph = helper.make_graph([node], "rows", inputs, [helper.make_tensor_value_info(n, T.FLOAT, None) for n in outs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(cpu_kernels.DOMAIN, 1)], ir_version=10)


def session(model, threads: int = 1):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    cpu_kernels.register(opts)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def reference(op: str, x, other, gamma, epsilon=1e-5):
    x, other = x.astype(np.float64), other.astype(np.float64)
    if op == "StreamSwiGLU":
        return x / (1 + np.exp(-x)) * other
    s = (x + other).astype(np.float32).astype(np.float64) if op == "StreamSkipNorm" else x
    return s / np.sqrt((s * s).mean(-1, keepdims=True) + epsilon) * gamma


def check_rows(threads: int) -> float:
    """Each op against float64 numpy for 0..20 rows and 120 (shared out over the threads), every row bitwise the
    same alone; the worst relative error."""
    rng = np.random.default_rng(threads)
    worst = 0.0
    for op in ("StreamNorm", "StreamSkipNorm", "StreamSwiGLU"):
        for k in WIDTHS:
            s = session(op_model(op, k), threads)
            gamma = rng.standard_normal(k).astype(np.float32)
            for m in (*range(21), 120):
                x = (rng.standard_normal((1, m, k)) * 3).astype(np.float32)
                other = rng.standard_normal((1, m, k)).astype(np.float32)
                feed = {"x": x, "gamma": gamma} if op == "StreamNorm" else {"x": x, "gamma": gamma, "skip": other} \
                    if op == "StreamSkipNorm" else {"x": x, "up": other}
                got = s.run(None, feed)
                assert got[0].shape == (1, m, k)
                if op == "StreamSkipNorm":
                    assert np.array_equal(got[1], x + other)  # the sum, as a float32 Add makes it
                if m:
                    ref = reference(op, x, other if op != "StreamNorm" else x * 0, gamma)
                    worst = max(worst, float(np.abs(got[0] - ref).max() / np.abs(ref).max()))
                for r in range(0, m, 7):
                    alone = s.run(None, {n: (v[:, r:r + 1] if v.ndim == 3 else v) for n, v in feed.items()})
                    assert np.array_equal(alone[0][0, 0], got[0][0, r]), (op, k, m, r)
    return worst


def test_special_values_and_a_row_of_zeros():
    s = session(op_model("StreamSwiGLU", 20))
    gate = np.array([[[np.inf, -np.inf, np.nan, -100.0, 100.0, 0.0, -0.0, 1.0] + [0.5] * 12]], np.float32)
    y = s.run(None, {"x": gate, "up": np.ones_like(gate)})[0][0, 0]
    assert y[0] == np.inf and np.isnan(y[1]) and np.isnan(y[2])  # as torch: -inf * sigmoid(-inf) is NaN
    assert abs(y[3]) < 1e-30 and y[4] == 100.0 and y[5] == 0.0 and y[6] == 0.0
    assert abs(y[7] - 1 / (1 + np.exp(-1.0))) < 1e-6
    n = session(op_model("StreamSkipNorm", 20))
    zeros = np.zeros((1, 2, 20), np.float32)
    out, total = n.run(None, {"x": zeros, "skip": zeros, "gamma": np.ones(20, np.float32)})
    assert not out.any() and not total.any()


def test_a_wrong_shape_is_refused_by_name_and_the_session_goes_on():
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

    s = session(op_model("StreamSkipNorm", 16))
    x = np.ones((1, 2, 16), np.float32)
    with pytest.raises(InvalidArgument, match="StreamSkipNorm"):
        s.run(None, {"x": x, "skip": x, "gamma": np.ones(15, np.float32)})
    with pytest.raises(InvalidArgument, match="StreamSkipNorm"):
        s.run(None, {"x": x, "skip": np.ones((1, 3, 16), np.float32), "gamma": np.ones(16, np.float32)})
    ok = s.run(None, {"x": x, "skip": x, "gamma": np.ones(16, np.float32)})[0]
    assert np.allclose(ok, 1.0)
    g = session(op_model("StreamSwiGLU", 16))
    with pytest.raises(InvalidArgument, match="StreamSwiGLU"):
        g.run(None, {"x": x, "up": np.ones((1, 3, 16), np.float32)})


@pytest.mark.parametrize("isa", ["generic", "avx512"])
def test_each_variant_matches_numpy_and_computes_a_row_the_same_alone(isa):
    if isa == "avx512" and cpu_kernels.isa() != "avx512":
        pytest.skip("this CPU has no AVX-512")
    env = {**os.environ, "RLXRT_CPU_KERNELS_ISA": isa}
    for threads in (1, 2):
        out = subprocess.run([sys.executable, __file__, str(threads)], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.strip().splitlines()[-1])["worst"] < 1e-5


# -- the rewrite ----------------------------------------------------------------------------------------------

def block_model(k: int = 48, n: int = 80, silu_out: bool = False, other_input: bool = False, mean_read: bool = False):
    """A decoder block's row-wise skeleton: norm, MatMuls to gate and up, g * sigmoid(g) * u, a MatMul down, a
    skip norm; ``silu_out`` also returns g * sigmoid(g), ``other_input`` computes up from another input,
    ``mean_read`` returns the skip norm's mean."""
    from onnx import TensorProto as T, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = {name: rng.standard_normal(shape).astype(np.float32) * 0.2
         for name, shape in (("wg", (k, n)), ("wu", (k, n)), ("wd", (n, k)))}
    nodes = [helper.make_node("SimplifiedLayerNormalization", ["x", "g1"], ["h"], epsilon=1e-5, axis=-1),
             helper.make_node("MatMul", ["h", "wg"], ["gate"]),
             helper.make_node("MatMul", ["x" if other_input else "h", "wu"], ["up"]),
             helper.make_node("Sigmoid", ["gate"], ["sig"]),
             helper.make_node("Mul", ["sig", "gate"], ["silu"]),
             helper.make_node("Mul", ["up", "silu"], ["act"]),
             helper.make_node("MatMul", ["act", "wd"], ["down"]),
             helper.make_node("SkipSimplifiedLayerNormalization", ["down", "x", "g2"],
                              ["out", "mean" if mean_read else "", "", "total"], domain="com.microsoft", epsilon=1e-5)]
    outs = ["out", "total"] + ["silu"] * silu_out + ["mean"] * mean_read
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", T.FLOAT, [1, "s", k])],
                              [helper.make_tensor_value_info(o, T.FLOAT, None) for o in outs],
                              [numpy_helper.from_array(v, name) for name, v in w.items()] +
                              [numpy_helper.from_array(rng.standard_normal(k).astype(np.float32), g) for g in ("g1", "g2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)], ir_version=10)


def rewritten(model):
    plan = cpu_kernels.plan(model, "rlxrt", "cpu")
    cpu_kernels.rewrite(model, plan)
    return plan, [n.op_type for n in model.graph.node]


def test_the_rewrite_fuses_a_block_and_keeps_its_outputs():
    import copy

    import onnxruntime as ort

    model = block_model()
    theirs = ort.InferenceSession(copy.deepcopy(model).SerializeToString(), providers=["CPUExecutionProvider"])
    plan, ops = rewritten(model)
    assert "2 norms and 1 SwiGLUs" in plan.state
    assert ops == ["StreamNorm", "StreamMatMul", "StreamMatMul", "StreamSwiGLU", "StreamMatMul", "StreamSkipNorm"]
    x = np.random.default_rng(1).standard_normal((1, 9, 48)).astype(np.float32)
    for got, want in zip(session(model).run(None, {"x": x}), theirs.run(None, {"x": x})):
        assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("variant", ["silu_out", "other_input", "mean_read"])
def test_what_the_rewrite_leaves_to_onnx_runtime(variant):
    plan, ops = rewritten(block_model(**{variant: True}))
    if variant == "mean_read":  # the skip norm's mean is read: it stays; the rest is fused
        assert ops.count("SkipSimplifiedLayerNormalization") == 1 and "StreamSwiGLU" in ops
        assert "1 norms and 1 SwiGLUs" in plan.state
    else:  # the SwiGLU's middle value is read, or gate and up read different inputs: Sigmoid, Mul, Mul stay
        assert ops.count("Mul") == 2 and "Sigmoid" in ops and "StreamSwiGLU" not in ops
        assert "2 norms and 0 SwiGLUs" in plan.state


def test_the_counts_the_plan_states_are_what_the_rewrite_does():
    model = block_model()
    assert fuse_rows.plan(model.graph, lambda node: None) == (2, 0)  # no MatMul of rlxrt's: no SwiGLU
    rewritten(model)
    assert fuse_rows.plan(model.graph, fuse_rows.rewritten_width) == (0, 0)  # nothing left to fuse


if __name__ == "__main__":  # one variant per process: the library picks it once
    print(json.dumps({"worst": check_rows(int(sys.argv[1]))}))
