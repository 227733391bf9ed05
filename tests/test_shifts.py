"""A GGUF Q4_1 weight's shift folded into rlxrt's int4 kernels, with int8 activations and in float32 arithmetic
(backends/shifts.py, stream_int8.h, stream_matmul.c): the rewrite of the pattern the fused exporter writes,
outputs against numpy and against ONNX Runtime's own nodes, a row the same alone or among others (with the same
bits in the generic C and VNNI int8 variants), what the rewrite leaves alone, and a wrong shift refused by name."""
import copy
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rlxrt.backends import cpu_kernels
from test_cpu_kernels import int8_reference, session

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="the kernel library was not built")
SHAPES = [(64, 100), (576, 70), (96, 32)]
"""(K, N): K a whole number of blocks (the pattern's Reshape needs it), N below, past and at a 32-column panel."""


def q41_model(k: int, n: int, weights: int = 2, extra_reader: bool = False, seed: int = 0, level: int = 4):
    """x [1, s, K] @ ``weights`` Q4_1 weights as the fused exporter writes them (MatMulNBits at accuracy level 4
    plus the block sums of x times a shift, the block sums shared); ``extra_reader`` also returns the first
    MatMulNBits' output; ``level`` 0 computes in float32. Returns (model, [(codes [N, K], scales, shift [K/32, N])
    per weight])."""
    from onnx import TensorProto as T, helper, numpy_helper

    from rlxrt.exporters.fused import int4_blocks

    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Reshape", ["x", "blocks"], ["xb"]),
             helper.make_node("ReduceSum", ["xb", "last"], ["sums"], keepdims=0)]
    inits = [numpy_helper.from_array(np.array([0, 0, k // 32, 32], np.int64), "blocks"),
             numpy_helper.from_array(np.array([-1], np.int64), "last")]
    outs, parts = [], []
    for i in range(weights):
        codes, scales = int4_blocks(rng.standard_normal((k, n)).astype(np.float32))
        shift = (rng.standard_normal((k // 32, n)) * 0.1).astype(np.float32)
        inits += [numpy_helper.from_array(codes, f"c{i}"), numpy_helper.from_array(scales, f"s{i}"),
                  numpy_helper.from_array(shift, f"w{i}.shift")]
        nodes += [helper.make_node("MatMulNBits", ["x", f"c{i}", f"s{i}"], [f"q{i}"], domain="com.microsoft", K=k,
                                   N=n, bits=4, block_size=32, accuracy_level=level),
                  helper.make_node("MatMul", ["sums", f"w{i}.shift"], [f"m{i}"]),
                  helper.make_node("Add", [f"q{i}", f"m{i}"], [f"y{i}"])]
        outs.append(f"y{i}")
        parts.append((cpu_kernels.unpack_codes(codes, 4), scales, shift))
    outs += ["q0"] * extra_reader
    graph = helper.make_graph(nodes, "q41", [helper.make_tensor_value_info("x", T.FLOAT, [1, "s", k])],
                              [helper.make_tensor_value_info(o, T.FLOAT, None) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)], ir_version=10)
    return model, parts


def reference(x, codes, scales, shift, level=4):
    """The kernel's arithmetic in float64: the int8 dot products (level 4) or x times the dequantised weight
    (level 0), plus each block's float sum times the shift."""
    m, k = x.shape
    sums = x.reshape(m, k // 32, 32).astype(np.float64).sum(-1) @ shift
    if level == 4:
        return int8_reference(x, codes, scales, 8) + sums
    weight = (codes.astype(np.float64) - 8) * np.repeat(scales.reshape(codes.shape[0], -1).astype(np.float64), 32, 1)
    return x.astype(np.float64) @ weight.T + sums


def check_shifts(threads: int) -> dict:
    """Against numpy for 0..14 and 40 rows, each row bitwise alone; a hash of every output (the C and VNNI
    variants must agree)."""
    rng = np.random.default_rng(threads)
    worst, outputs = 0.0, hashlib.sha256()
    for (k, n), level in [(shape, level) for shape in SHAPES for level in (4, 0)]:
        model, parts = q41_model(k, n, level=level)
        s = session(model, threads)
        assert [nd.op_type for nd in model.graph.node] == ["StreamMatMulQx8" if level else "StreamMatMulQ4"] * 2
        for m in (*range(15), 40):
            x = rng.standard_normal((1, m, k)).astype(np.float32)
            ys = s.run(None, {"x": x})
            for y, part in zip(ys, parts):
                if level:
                    outputs.update(y.tobytes())
                assert y.shape == (1, m, n)
                if m:
                    ref = reference(x[0], *part, level)
                    worst = max(worst, float(np.abs(y[0] - ref).max() / (np.abs(ref).max() + 1e-6)))
            for r in range(m):
                alone = s.run(None, {"x": x[:, r:r + 1]})
                assert all(np.array_equal(a[0, 0], y[0, r]) for a, y in zip(alone, ys)), (k, n, m, r)
    return {"worst": worst, "outputs": outputs.hexdigest(), "int8_isa": cpu_kernels.int8_isa(), "isa": cpu_kernels.isa()}


@pytest.mark.parametrize("level", [4, 0])
def test_the_rewrite_folds_the_shift_and_keeps_onnx_runtimes_outputs(level):
    import onnxruntime as ort

    model, parts = q41_model(576, 70, level=level)
    theirs = ort.InferenceSession(copy.deepcopy(model).SerializeToString(), providers=["CPUExecutionProvider"])
    plan = cpu_kernels.plan(model, "rlxrt", "cpu")
    assert "2 with a Q4_1 shift" in plan.state and plan.rows_exact, plan.state
    cpu_kernels.rewrite(model, plan)
    op = "StreamMatMulQx8" if level else "StreamMatMulQ4"
    assert [(nd.op_type, len(nd.input)) for nd in model.graph.node] == [(op, 4)] * 2
    assert {t.name for t in model.graph.initializer}.isdisjoint({"blocks", "last", "w0.shift", "w1.shift"})
    x = np.random.default_rng(3).standard_normal((1, 5, 576)).astype(np.float32)
    for got, want, part in zip(session(model).run(None, {"x": x}), theirs.run(None, {"x": x}), parts):
        ref = reference(x[0], *part, level)
        assert np.abs(got[0] - ref).max() < 1e-5 * np.abs(ref).max()
        # ONNX Runtime quantises x its own way at level 4; at level 0 both are float32 arithmetic
        assert np.abs(got - want).max() < (0.05 if level else 1e-5) * np.abs(want).max()


def test_a_quantised_output_read_elsewhere_keeps_the_pattern():
    model, _ = q41_model(64, 40, extra_reader=True)  # the first weight's MatMulNBits output is a graph output too
    plan = cpu_kernels.plan(model, "rlxrt", "cpu")
    assert "1 with a Q4_1 shift" in plan.state, plan.state  # the second weight's only
    cpu_kernels.rewrite(model, plan)
    ops = [(nd.op_type, len(nd.input)) for nd in model.graph.node]
    assert ops.count(("StreamMatMulQx8", 3)) == 1 and ops.count(("StreamMatMulQx8", 4)) == 1
    assert [op for op, _ in ops].count("Add") == 1 and ("ReduceSum", 2) in ops  # its block sums still read
    assert [op for op, _ in ops].count("StreamMatMul") == 1  # its shift: a float MatMul on rlxrt's kernel


def test_a_wrong_shift_is_refused_by_name_and_the_session_goes_on():
    from onnx import numpy_helper
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

    model, _ = q41_model(64, 40, weights=1)
    cpu_kernels.rewrite(model, cpu_kernels.plan(model, "rlxrt", "cpu"))
    good = session(copy.deepcopy(model))
    shift = next(t for t in model.graph.initializer if t.name.endswith(".panels"))
    shift.CopyFrom(numpy_helper.from_array(np.zeros((2, 1, 32), np.float32), shift.name))  # [P, K/32 - 1, 32]
    bad = session(model)
    x = np.ones((1, 2, 64), np.float32)
    with pytest.raises(InvalidArgument, match="StreamMatMulQx8: the shift"):
        bad.run(None, {"x": x})
    assert np.isfinite(good.run(None, {"x": x})[0]).all()


def test_the_c_and_vnni_variants_agree_bit_for_bit_and_match_numpy():
    """Every variant against numpy; the int8 outputs the same bits in C and VNNI (float32 arithmetic differs by
    variant, as the kernel's own tests allow)."""
    runs = {}
    for isa in ("generic", "avx2", "avx512"):
        env = {**os.environ, "RLXRT_CPU_KERNELS_ISA": isa}
        out = subprocess.run([sys.executable, __file__, "2"], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[isa] = json.loads(out.stdout.strip().splitlines()[-1])
        assert runs[isa]["worst"] < 1e-5, runs[isa]  # a variant this CPU lacks falls back to one it has
    if runs["avx512"]["int8_isa"] != "avx512vnni":
        pytest.skip("this CPU has no AVX-512 VNNI: only the generic int8 kernel runs")
    assert runs["generic"]["outputs"] == runs["avx512"]["outputs"]


if __name__ == "__main__":  # one variant per process: the library picks it once
    print(json.dumps(check_shifts(int(sys.argv[1]))))
