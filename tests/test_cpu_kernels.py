"""rlxrt's CPU MatMul kernel (backends/stream_matmul.c, backends/cpu_kernels.py): the custom op against numpy in
every vector width this CPU runs, a row's output the same alone or among others, the graph rewrite, the
choice in compile(), the cache, typed errors, and exact speculation over rewritten exported graphs."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rlxrt import Config, ConfigError, ProviderError, compile, load_config
from rlxrt.backends import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="the kernel library was not built")
SHAPES = [(70, 100), (64, 32), (5, 1), (33, 64), (256, 1000), (300, 200), (256, 96)]
"""(K, N): N below, at and past a 32-column panel, a single column, odd K; K >= 256 (a lone row takes 4 strips
at once there) with and without a partial last panel."""
Q4_SHAPES = [(64, 100), (32, 1), (576, 70), (96, 32), (48, 40), (688 - 640, 33)]
"""(K, N) of int4 weights: K a multiple of the 32-row block, or not (the last block padded with weight-0 codes,
as an intermediate size of 688 gives)."""


def matmul_model(weights, rank: int = 3, shared: bool = False):
    """x [.., K] @ each weight (the first weight twice when ``shared``); outputs y0, y1, …"""
    from onnx import TensorProto, helper, numpy_helper

    k = weights[0].shape[0]
    names = [f"w{i}" for i in range(len(weights))] + (["w0"] if shared else [])
    nodes = [helper.make_node("MatMul", ["x", w], [f"y{i}"], name=f"mm{i}") for i, w in enumerate(names)]
    dims = ["b", "s", k][-rank:]
    graph = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(len(names))],
                              [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def int4_model(w: np.ndarray, level: int = 0, zero_points: bool = False):
    """x [1, s, K] @ an int4 MatMulNBits over ``w`` [K, N], as ``rlxrt export --quantize int4`` writes it;
    returns (model, the dequantised weight in float64)."""
    from onnx import TensorProto, helper, numpy_helper

    from rlxrt.exporters.fused import int4_blocks

    k, n = w.shape
    codes, scales = int4_blocks(w)
    unpacked = np.stack([codes & 15, codes >> 4], -1).reshape(n, -1).astype(np.float64)
    dequant = ((unpacked - 8) * np.repeat(scales.reshape(n, -1).astype(np.float64), 32, axis=1))[:, :k].T
    inits = [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scales, "scales")]
    inputs = ["x", "codes", "scales"]
    if zero_points:
        inits.append(numpy_helper.from_array(np.full(n * (k // 32 + 1) // 2, 0x88, np.uint8), "zeros"))
        inputs.append("zeros")
    node = helper.make_node("MatMulNBits", inputs, ["y0"], domain="com.microsoft", K=k, N=n, bits=4, block_size=32,
                            accuracy_level=level)
    graph = helper.make_graph([node], "q4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "s", k])],
                              [helper.make_tensor_value_info("y0", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    return model, dequant


def int8_model(w: np.ndarray):
    """x [1, s, K] @ an 8-bit MatMulNBits at accuracy level 4 (the GGUF Q8_0 output layer's form); returns
    (model, codes [N, K], scales [N, K/32])."""
    from onnx import TensorProto, helper, numpy_helper

    k, n = w.shape
    padded = np.zeros((-(-k // 32) * 32, n), np.float32)
    padded[:k] = w
    blocks = padded.T.reshape(n, -1, 32)
    scales = (np.abs(blocks).max(-1) / 127).astype(np.float32)
    codes = (np.rint(blocks / np.where(scales > 0, scales, 1)[..., None]) + 128).clip(0, 255).astype(np.uint8)
    node = helper.make_node("MatMulNBits", ["x", "codes", "scales"], ["y0"], domain="com.microsoft", K=k, N=n,
                            bits=8, block_size=32, accuracy_level=4)
    graph = helper.make_graph([node], "q8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "s", k])],
                              [helper.make_tensor_value_info("y0", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scales.reshape(-1), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    return model, codes.reshape(n, -1), scales


def int8_reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, zero: int) -> np.ndarray:
    """stream_int8.h's arithmetic in numpy: activations quantised per row and block of 32 in float32, exact
    integer dot products, then (s * d) * (dot - zero * sum_q) summed over blocks (float64 here)."""
    x = np.pad(x, ((0, 0), (0, codes.shape[1] - x.shape[1])))  # a K short of whole blocks reads zeros
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    top = np.abs(xb).max(-1)
    inverse = np.where(top > 0, np.float32(127) / np.where(top > 0, top, 1), np.float32(0)).astype(np.float32)
    q = np.rint(xb * inverse[..., None]).astype(np.int64)
    d = (top / np.float32(127)).astype(np.float32)
    dots = np.einsum("mbj,nbj->mbn", q, codes.reshape(codes.shape[0], k // 32, 32).astype(np.int64))
    dots = dots - zero * q.sum(-1)[..., None]
    sd = (scales.reshape(-1, k // 32).T[None].astype(np.float32) * d[..., None]).astype(np.float64)
    return (sd * dots).sum(1)


def attention_model(window: int = -1, packed: bool = True, heads=(6, 2), d: int = 32, cap: int = 64):
    """One GroupQueryAttention node as rlxrt's fused graph writes it (rotary inside, one KV buffer)."""
    from onnx import TensorProto as T, helper, numpy_helper

    h, kv = heads
    inv = 1 / 10000 ** (np.arange(0, d, 2) / d)
    angles = np.outer(np.arange(cap), inv)
    ins = ["qkv", "", ""] if packed else ["q", "k", "v"]
    node = helper.make_node("GroupQueryAttention", ins + ["pk", "pv", "seqlens_k", "total", "cos", "sin"],
                            ["out", "prk", "prv"], domain="com.microsoft", num_heads=h, kv_num_heads=kv,
                            scale=d ** -0.5, do_rotary=1, rotary_interleaved=0, local_window_size=window)
    widths = [("qkv", (h + 2 * kv) * d)] if packed else [("q", h * d), ("k", kv * d), ("v", kv * d)]
    inputs = [helper.make_tensor_value_info(n, T.FLOAT, [1, "s", w]) for n, w in widths] + [
        helper.make_tensor_value_info(n, T.FLOAT, [1, kv, cap, d]) for n in ("pk", "pv")] + [
        helper.make_tensor_value_info("seqlens_k", T.INT32, [1]), helper.make_tensor_value_info("total", T.INT32, [])]
    graph = helper.make_graph([node], "att", inputs, [helper.make_tensor_value_info(n, T.FLOAT, None)
                                                      for n in ("out", "prk", "prv")],
                              [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
                               numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def check_attention(threads: int, rng) -> float:
    """StreamAttention against ONNX Runtime's GroupQueryAttention (outputs, the keys and values written), and a
    multi-row call against one-row calls, bit for bit: head sizes 32, 64 and 80, one to three query heads a kv
    head, windows that leave the rows of a call keys in common (5) and none (2), and a capacity that is not a
    multiple of the keys' blocks of 16, the call's keys in its last, narrower block."""
    import copy

    import onnxruntime as ort

    worst = 0.0
    for (h, kv, d, n), window, packed, cap, at in [((6, 2, 32, 3), w, p, 64, 20) for w in (-1, 5) for p in (True, False)] + [
            ((4, 4, 64, 5), -1, True, 64, 20), ((4, 2, 64, 5), 2, True, 64, 20), ((2, 1, 32, 5), 2, False, 64, 20),
            ((4, 4, 80, 5), -1, True, 64, 20), ((6, 2, 80, 3), 5, False, 64, 20),  # 80: walks of fewer chunks
            ((6, 2, 64, 5), -1, True, 45, 36), ((6, 2, 64, 4), 5, False, 45, 37)]:
        model = attention_model(window, packed, (h, kv), d, cap)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        theirs = ort.InferenceSession(copy.deepcopy(model).SerializeToString(), opts, providers=["CPUExecutionProvider"])
        ours = session(model, threads)
        assert [nd.op_type for nd in model.graph.node] == ["StreamAttention"]
        x = rng.standard_normal((1, n, (h + 2 * kv) * d)).astype(np.float32)
        past = rng.standard_normal((2, 1, kv, cap, d)).astype(np.float32)

        def feed(rows, at, k, v):
            xs = x[:, rows]
            parts = {"qkv": xs} if packed else {"q": xs[..., :h * d].copy(), "k": xs[..., h * d:(h + kv) * d].copy(),
                                                "v": xs[..., (h + kv) * d:].copy()}
            return {**parts, "pk": k, "pv": v, "seqlens_k": np.array([at + xs.shape[1] - 1], np.int32),
                    "total": np.array(at + xs.shape[1], np.int32)}
        want = theirs.run(None, feed(slice(0, n), at, past[0].copy(), past[1].copy()))
        blocked = cpu_kernels.keys_in_blocks(past[0])  # StreamAttention keeps its keys in blocks of 16 positions
        got = ours.run(None, feed(slice(0, n), at, blocked.copy(), past[1].copy()))
        end = at + n
        keys = cpu_kernels.keys_in_order(got[1])
        worst = max(worst, float(np.abs(got[0] - want[0]).max()), float(np.abs(keys[:, :, :end] - want[1][:, :, :end]).max()))
        assert np.array_equal(keys[:, :, :at], past[0][:, :, :at]) and np.array_equal(keys[:, :, end:], past[0][:, :, end:])
        assert np.array_equal(got[2][:, :, :end], want[2][:, :, :end])
        k, v, rows = blocked.copy(), past[1].copy(), []
        for i in range(n):
            out, k, v = ours.run(None, feed(slice(i, i + 1), at + i, k, v))
            rows.append(out)
        assert np.array_equal(np.concatenate(rows, 1), got[0]) and np.array_equal(k, got[1]), (h, kv, d, window, packed)
    return worst


def session(model, threads: int = 1):
    import onnxruntime as ort

    plan = cpu_kernels.plan(model, "rlxrt", "cpu")
    cpu_kernels.rewrite(model, plan)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    cpu_kernels.register(opts)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def check_kernel(threads: int) -> dict:
    """The kernel against float64 numpy for every shape and 0..14 rows, and each row alone (bitwise)."""
    rng = np.random.default_rng(threads)
    worst, x8_outputs = 0.0, hashlib.sha256()
    for k, n in SHAPES:
        w = rng.standard_normal((k, n)).astype(np.float32)
        for rank in (2, 3):
            s = session(matmul_model([w], rank=rank), threads)
            for m in range(15):
                x = rng.standard_normal((m, k) if rank == 2 else (1, m, k)).astype(np.float32)
                y = s.run(None, {"x": x})[0]
                ref = x.astype(np.float64) @ w
                assert y.shape == ref.shape, (k, n, m, y.shape)
                if m:
                    worst = max(worst, float(np.abs(y - ref).max() / (np.abs(ref).max() + 1e-6)))
                for r in range(m):  # alone, as a one-row step computes it
                    alone = s.run(None, {"x": x[r:r + 1] if rank == 2 else x[:, r:r + 1]})[0]
                    assert np.array_equal(alone.reshape(-1), y.reshape(m, n)[r]), (k, n, m, r)
    for k, n in Q4_SHAPES:
        w = rng.standard_normal((k, n)).astype(np.float32)
        model, dequant = int4_model(w)
        s = session(model, threads)
        assert [nd.op_type for nd in model.graph.node] == ["StreamMatMulQ4"]
        for m in range(15):
            x = rng.standard_normal((1, m, k)).astype(np.float32)
            y = s.run(None, {"x": x})[0]
            assert y.shape == (1, m, n)
            if m:
                ref = x[0].astype(np.float64) @ dequant
                worst = max(worst, float(np.abs(y[0] - ref).max() / (np.abs(ref).max() + 1e-6)))
            for r in range(m):
                assert np.array_equal(s.run(None, {"x": x[:, r:r + 1]})[0][0, 0], y[0, r]), ("int4", k, n, m, r)
    for k, n in Q4_SHAPES:  # int8 activations over 4- and 8-bit codes
        w = rng.standard_normal((k, n)).astype(np.float32)
        for bits in (4, 8):
            if bits == 4:
                from rlxrt.exporters.fused import int4_blocks

                model = int4_model(w, level=4)[0]
                c4, sc = int4_blocks(w)
                codes, scales, zero = cpu_kernels.unpack_codes(c4, 4), sc, 8
            else:
                model, codes, scales = int8_model(w)
                zero = 128
            s = session(model, threads)
            assert [nd.op_type for nd in model.graph.node] == ["StreamMatMulQx8"]
            for m in (*range(15), 40):  # 40: chunks of rows over codes unpacked once
                x = rng.standard_normal((1, m, k)).astype(np.float32)
                if m == 3:
                    x[0, 1] = 0  # a row of zeros quantises to zeros
                if m == 40:
                    x[0, 5, 7], x[0, 6, :] = np.nan, 0.5 * np.arange(k) - 9.5  # a NaN in its block; ties at .5
                y = s.run(None, {"x": x})[0]
                x8_outputs.update(y.tobytes())
                assert y.shape == (1, m, n)
                if m == 40:
                    ok = np.ones(m, bool)
                    ok[5] = False  # the NaN's row: no reference
                    assert np.isnan(y[0, 5]).all()  # a NaN's block says so, not a finite number
                    ref = int8_reference(x[0, ok], codes, scales, zero)
                    worst = max(worst, float(np.abs(y[0, ok] - ref).max() / (np.abs(ref).max() + 1e-6)))
                elif m:
                    ref = int8_reference(x[0], codes, scales, zero)
                    worst = max(worst, float(np.abs(y[0] - ref).max() / (np.abs(ref).max() + 1e-6)))
                for r in range(m):
                    alone = s.run(None, {"x": x[:, r:r + 1]})[0][0, 0]
                    assert np.array_equal(alone, y[0, r], equal_nan=True), ("x8", bits, k, n, m, r)
    assert worst < 1e-5, worst
    assert check_attention(threads, rng) < 1e-5
    return {"isa": cpu_kernels.isa(), "int8_isa": cpu_kernels.int8_isa(), "worst": worst,
            "x8_outputs": x8_outputs.hexdigest()}


def isas() -> list[str]:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return ["generic"] + [name for name, need in (("avx2", ("avx2", "fma")), ("avx512", ("avx512f",)))
                          if all(f" {f}" in flags for f in need)]


@pytest.mark.parametrize("isa", isas())
def test_every_vector_width_matches_numpy_and_computes_a_row_the_same_alone(isa):
    env = {**os.environ, "RLXRT_CPU_KERNELS_ISA": isa}
    for threads in (1, 2):
        out = subprocess.run([sys.executable, __file__, str(threads)], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["isa"] == isa and got["worst"] < 1e-5


def test_the_int8_activation_kernel_computes_the_same_bits_in_c_and_with_vnni():
    """The generic C and the VNNI variants (its vectorised quantisation, its codes unpacked once for many rows)
    give the same outputs, bit for bit, at each thread count."""
    runs = {}
    for isa in ("generic", "avx512"):
        env = {**os.environ, "RLXRT_CPU_KERNELS_ISA": isa}
        out = subprocess.run([sys.executable, __file__, "1"], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[isa] = json.loads(out.stdout.strip().splitlines()[-1])
    if runs["avx512"]["int8_isa"] != "avx512vnni":
        pytest.skip("this CPU has no AVX-512 VNNI: only the generic int8 kernel runs")
    assert runs["generic"]["int8_isa"] == "generic"
    assert runs["generic"]["x8_outputs"] == runs["avx512"]["x8_outputs"]


def test_which_matmulnbits_the_kernel_takes():
    from onnx import numpy_helper

    w = np.random.default_rng(4).standard_normal((64, 40)).astype(np.float32)
    assert cpu_kernels.plan(int4_model(w, zero_points=True)[0], "rlxrt", "cpu").nodes == []
    model, _ = int4_model(w)
    plan = cpu_kernels.plan(model, "rlxrt", "cpu")
    assert plan.nodes == [0] and plan.state.startswith("on: 1 MatMuls (1 int4)")
    cpu_kernels.rewrite(model, plan)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert sorted(inits) == ["codes.codes", "codes.scales"]  # MatMulNBits' own blocks are dropped
    assert inits["codes.codes"].shape == (2, 64, 16) and inits["codes.scales"].shape == (2, 2, 32)
    assert not inits["codes.scales"][1, :, 8:].any() and (inits["codes.codes"][1, :, 8:16] == 0x88).all()
    level4, _ = int4_model(w, level=4)
    plan = cpu_kernels.plan(level4, "rlxrt", "cpu")
    assert "1 with int8 activations" in plan.state
    cpu_kernels.rewrite(level4, plan)
    assert [(n.op_type, sorted((a.name, a.i) for a in n.attribute)) for n in level4.graph.node] == [
        ("StreamMatMulQx8", [("bits", 4), ("n", 40)])]
    codes = {t.name: numpy_helper.to_array(t) for t in level4.graph.initializer}["codes.codes_x8"]
    assert codes.shape == (2, 16, 2, 32)


def test_a_wrong_input_width_is_refused_and_the_session_goes_on():
    w = np.ones((8, 40), np.float32)
    model = matmul_model([w])
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "k"  # let a wrong width reach the kernel
    s = session(model)
    with pytest.raises(Exception, match="last dimension must equal the weight's K"):
        s.run(None, {"x": np.ones((1, 2, 9), np.float32)})
    assert np.array_equal(s.run(None, {"x": np.ones((1, 2, 8), np.float32)})[0], np.full((1, 2, 40), 8, np.float32))


def test_the_rewrite_packs_each_weight_once_and_keeps_what_others_read():
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    w0, w1 = rng.standard_normal((16, 40)).astype(np.float32), rng.standard_normal((16, 8)).astype(np.float32)
    model = matmul_model([w0, w1], shared=True)
    model.graph.node.append(helper.make_node("Identity", ["w1"], ["w1_copy"]))  # w1 is read by another node
    model.graph.output.append(helper.make_tensor_value_info("w1_copy", 1, None))
    model.graph.node.append(helper.make_node("MatMul", ["x", "x_t"], ["not_a_weight"]))  # B is no initializer
    plan = cpu_kernels.plan(model, "rlxrt", "cpu")
    assert plan.nodes == [0, 1, 2] and plan.weight_bytes == (16 * 40 + 16 * 8) * 4
    cpu_kernels.rewrite(model, plan)
    ops = [(n.op_type, n.domain) for n in model.graph.node]
    assert ops[:3] == [("StreamMatMul", "ai.rlxrt")] * 3 and ops[4] == ("MatMul", "")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert sorted(inits) == ["w0.panels", "w1", "w1.panels"]  # w0 read only by MatMuls: dropped
    assert inits["w0.panels"].shape == (2, 16, 32) and not inits["w0.panels"][1, :, 8:].any()
    np.testing.assert_array_equal(inits["w0.panels"][1, :, :8], w0[:, 32:])
    assert [a.i for a in model.graph.node[0].attribute] == [40]


def gemm_model(table: np.ndarray):
    """The LM heads of a fused graph: Gemm(x, table, transB=1) in the main graph and in both branches of an If
    (as the greedy head has it), beside Gemms the kernel does not cover (a bias, alpha, transA)."""
    from onnx import TensorProto, helper, numpy_helper

    def branch(name, out):
        return helper.make_graph([helper.make_node("Gemm", ["x", "table"], [out], transB=1)], name, [],
                                 [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])
    v, k = table.shape
    nodes = [helper.make_node("Gemm", ["x", "table"], ["main"], transB=1),
             helper.make_node("If", ["flag"], ["chosen"], then_branch=branch("a", "ya"), else_branch=branch("b", "yb")),
             helper.make_node("Gemm", ["x", "table", "bias"], ["biased"], transB=1),
             helper.make_node("Gemm", ["x", "table"], ["scaled"], transB=1, alpha=2.0),
             helper.make_node("Gemm", ["xt", "table"], ["transposed"], transA=1, transB=1)]
    graph = helper.make_graph(
        nodes, "heads", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k]),
                         helper.make_tensor_value_info("xt", TensorProto.FLOAT, [k, "m"]),
                         helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
         for o in ("main", "chosen", "biased", "scaled", "transposed")],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.ones(v, np.float32), "bias")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_lm_head_gemms_in_the_graph_and_in_if_branches():
    table = np.random.default_rng(2).standard_normal((100, 24)).astype(np.float32)
    model = gemm_model(table)
    plan = cpu_kernels.plan(model, "rlxrt", "cpu")
    assert plan.nodes == [0, 2, 3] and plan.weight_bytes == table.nbytes  # main, then-branch, else-branch
    s = session(model)
    x = np.random.default_rng(3).standard_normal((5, 24)).astype(np.float32)
    feeds = {"x": x, "xt": np.ascontiguousarray(x.T)}
    ref = x.astype(np.float64) @ table.T.astype(np.float64)
    for flag in (True, False):
        main, chosen, biased, scaled, transposed = s.run(None, {**feeds, "flag": np.array(flag)})
        np.testing.assert_allclose(main, ref, rtol=1e-5, atol=1e-5)
        assert np.array_equal(chosen, main)
        np.testing.assert_allclose(biased, ref + 1, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(scaled, 2 * ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(transposed, ref, rtol=1e-5, atol=1e-5)
    names = sorted(t.name for t in model.graph.initializer)
    assert names == ["bias", "table", "table.panels_t"]  # the table is still read by the Gemms left alone


def test_what_the_plan_leaves_alone(monkeypatch):
    model = matmul_model([np.ones((4, 4), np.float32)])
    assert cpu_kernels.plan(model, "ort", "cpu").state == "off: cpu_kernels = ort in config"
    assert cpu_kernels.plan(model, "rlxrt", "cuda").state == "off: the session runs on cuda"
    monkeypatch.setattr(cpu_kernels, "isa", lambda: "avx2")
    auto = cpu_kernels.plan(model, "auto", "cpu")
    assert not auto.nodes and "runs avx2 here" in auto.state and "cpu_kernels = rlxrt forces it" in auto.state
    assert cpu_kernels.plan(model, "rlxrt", "cpu").nodes == [0]
    monkeypatch.setattr(cpu_kernels, "isa", lambda: "avx512")
    assert cpu_kernels.plan(model, "auto", "cpu").state.startswith("on: 1 MatMuls")
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    assert "not built at install" in cpu_kernels.plan(model, "auto", "cpu").state
    with pytest.raises(ProviderError, match="cpu_kernels = rlxrt.*set cpu_kernels = auto"):
        cpu_kernels.plan(model, "rlxrt", "cpu")
    del model.graph.node[:]
    assert cpu_kernels.plan(model, "rlxrt", "cpu").state.startswith("off: no float32 MatMul")


def test_the_config_key():
    assert Config().cpu_kernels == "auto"
    assert load_config(env={"RLXRT_CPU_KERNELS": "ORT"}).cpu_kernels == "ort"
    with pytest.raises(ConfigError, match="'cpu_kernels'.*auto, rlxrt, ort.*'mlas'"):
        Config(cpu_kernels="mlas")


def test_compile_rewrites_caches_and_says_so(tmp_path):
    from conftest import make_mlp_onnx

    path = make_mlp_onnx(tmp_path / "mlp" / "model.onnx", external=True)
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    outs = {}
    for mode in ("ort", "rlxrt", "rlxrt"):
        g = compile(path, Config(intra_op_threads=1, cache_dir=str(tmp_path / "c"), cpu_kernels=mode))
        outs.setdefault(mode, []).append((g.cache, g.session.run(None, {"x": x})[0], g.cache_path))
        assert g.to_dict()["cpu_kernels"] == g.cpu_kernels
        assert g.cpu_kernels.startswith("on: 2 MatMuls") if mode == "rlxrt" else g.cpu_kernels.startswith("off: ")
    (c_ort, y_ort, p_ort), = outs["ort"]
    (c1, y1, p1), (c2, y2, p2) = outs["rlxrt"]
    assert (c_ort, c1, c2) == ("miss", "miss", "hit") and p1 == p2 != p_ort
    assert not any(f.name.startswith("source.onnx") for f in p1.iterdir())  # the rewritten input is gone
    np.testing.assert_allclose(y1, y_ort, rtol=1e-5, atol=1e-5)
    assert np.array_equal(y1, y2)
    import onnx

    cached = onnx.load(str(p1 / "model.onnx"), load_external_data=False)
    assert sum(n.op_type == "StreamMatMul" for n in cached.graph.node) == 2
    g = compile(path, Config(intra_op_threads=1, cache=False, cpu_kernels="rlxrt"))  # no cache: a temporary copy
    assert g.cache.startswith("off") and np.array_equal(g.session.run(None, {"x": x})[0], y1)


def test_nowhere_to_write_the_rewritten_graph_falls_back_to_ort_and_says_so(mlp, monkeypatch, caplog):
    import tempfile

    def refuse(*a, **kw):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    x = np.ones((3, 16), np.float32)
    with caplog.at_level("WARNING", logger="rlxrt"):
        g = compile(mlp, Config(intra_op_threads=1, cache=False, cpu_kernels="rlxrt"))
    assert g.cpu_kernels.startswith("off: the rewritten graph could not be written") and "Permission" in caplog.text
    want = compile(mlp, Config(intra_op_threads=1, cache=False, cpu_kernels="ort")).session.run(None, {"x": x})[0]
    np.testing.assert_allclose(g.session.run(None, {"x": x})[0], want, rtol=1e-6)


@pytest.mark.export
@pytest.mark.parametrize("graph", ["fused", "portable"])
def test_greedy_speculation_over_the_kernel_is_exact(exported, graph):
    from rlxrt.sessions import DraftModel, PromptLookup, Session

    target, draft = exported("llama", graph=graph), exported("llama", seed=1, graph=graph)
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    outs = {}
    for mode in ("ort", "rlxrt"):
        cfg = Config(intra_op_threads=1, cache=False, cpu_kernels=mode)
        t, d = compile(target, cfg), compile(draft, cfg)
        assert t.cpu_kernels.startswith("on: " if mode == "rlxrt" else "off: ")
        plain = Session(t).generate(prompt, max_new_tokens=40, ignore_eos=True).token_ids
        for k in (1, 3, 8):
            for spec in (DraftModel(d), PromptLookup()):
                got = Session(t, spec, k=k).generate(prompt, max_new_tokens=40, ignore_eos=True)
                assert got.token_ids == plain, (mode, k, type(spec).__name__)
        outs[mode] = plain
    assert len(outs["rlxrt"]) == 40



@pytest.mark.export
def test_an_int4_target_through_the_kernel_stays_close_to_ort_and_speculates_exactly(exported, tmp_path):
    import rlxrt
    from rlxrt.sessions import DraftModel, PromptLookup, Session, decoder_for

    src = exported.source("llama", seed=4, init=0.02)
    q4 = tmp_path / "q4"
    rlxrt.export(src, q4, quantize="int4")
    ids = list(range(3, 40))
    logits, plain = {}, {}
    for mode in ("ort", "rlxrt"):
        cfg = Config(intra_op_threads=1, cache=False, cpu_kernels=mode)
        g = compile(q4, cfg)
        assert ("int4)" in g.cpu_kernels) == (mode == "rlxrt")
        logits[mode] = decoder_for(g).forward(ids)
        prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
        plain[mode] = Session(g).generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids
        for spec in (DraftModel(compile(q4, cfg)), PromptLookup()):
            for k in (1, 3, 8):
                got = Session(g, spec, k=k).generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids
                assert got == plain[mode], (mode, k, type(spec).__name__)
    np.testing.assert_allclose(logits["rlxrt"], logits["ort"], atol=1e-4)  # the same dequantised weights



@pytest.mark.export
def test_a_float32_fused_graph_on_rlxrts_kernels_verifies_bit_for_bit(exported):
    """Every MatMul and attention of a fused float32 graph on rlxrt's kernels: the logits and hidden states of
    a 5-row verification equal five one-row steps bit for bit (ONNX Runtime's kernels differ by ~1e-6)."""
    from rlxrt.sessions import decoder_for

    target = exported("llama", with_hidden=True)
    ids = list(range(3, 40))
    diffs = {}
    for mode in ("rlxrt", "ort"):
        g = compile(target, Config(intra_op_threads=1, cache=False, cpu_kernels=mode))
        assert g.rows_exact == (mode == "rlxrt")
        model = decoder_for(g)
        model.fetch_hidden()
        model.forward(ids[:30])
        many = model.forward(ids[30:35], rows=5).copy(), model.hidden.copy()
        model.commit(30)
        single = [(model.forward(ids[i:i + 1], rows=1).copy(), model.hidden.copy()) for i in range(30, 35)]
        diffs[mode] = (float(np.abs(many[0] - np.concatenate([s[0] for s in single])).max()),
                       float(np.abs(many[1][-5:] - np.concatenate([s[1] for s in single])).max()))
    assert diffs["rlxrt"] == (0.0, 0.0) and max(diffs["ort"]) < 1e-3, diffs


@pytest.mark.export
def test_an_int8_activation_target_speculates_exactly_on_rlxrts_kernels(exported, tmp_path):
    """--int4-compute int8 on ONNX Runtime's kernels is refused a speculator (test_fused.py): its level-4
    MatMul and its GroupQueryAttention compute a (k+1)-row call differently from one-row calls, and quantising
    the activations turns a difference of 1e-7 into another int8 value now and then. On rlxrt's kernels every
    row is computed alike (CompiledGraph.rows_exact): hidden states of a verification equal one-row steps bit
    for bit, and greedy speculation equals plain greedy."""
    import rlxrt
    from rlxrt.sessions import DraftModel, PromptLookup, Session, decoder_for

    src = exported.source("llama", seed=4, init=0.02)
    fast = tmp_path / "q4i8"
    rlxrt.export(src, fast, quantize="int4", int4_compute="int8", with_hidden_states=True)
    cfg = Config(intra_op_threads=1, cache=False, cpu_kernels="rlxrt")
    g = compile(fast, cfg)
    assert g.rows_exact and "with int8 activations" in g.cpu_kernels and "attention" in g.cpu_kernels
    assert g.to_dict()["rows_exact"]
    on_ort = compile(fast, Config(intra_op_threads=1, cache=False, cpu_kernels="ort"))
    assert not on_ort.rows_exact
    ids = list(range(3, 40))
    model = decoder_for(g)
    model.fetch_hidden()
    model.forward(ids[:30])
    many = model.forward(ids[30:35], rows=5).copy(), model.hidden.copy()  # the model's buffers: copied
    model.commit(30)
    single = [(model.forward(ids[i:i + 1], rows=1).copy(), model.hidden.copy()) for i in range(30, 35)]
    assert np.array_equal(many[0], np.concatenate([s[0] for s in single]))
    assert np.array_equal(many[1][-5:], np.concatenate([s[1] for s in single]))
    theirs = decoder_for(on_ort).forward(ids)
    ours = decoder_for(compile(fast, cfg)).forward(ids)
    assert np.abs(ours - theirs).max() < 0.05 * max(1.0, np.abs(theirs).max())  # the same quantisation
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    plain = Session(g).generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids
    for spec in (DraftModel(compile(fast, cfg)), PromptLookup()):
        for k in (1, 3, 8):
            got = Session(g, spec, k=k).generate(prompt, max_new_tokens=30, ignore_eos=True)
            assert got.token_ids == plain and got.stats.drafted > 0, (k, type(spec).__name__)


if __name__ == "__main__":  # one vector width per process: the kernel picks it once
    print(json.dumps(check_kernel(int(sys.argv[1]))))
