"""The greedy head of a fused fp32 graph: the argmax of the logits without computing all of them.

The LM head is the largest single read of a small model's step, and greedy decoding needs only its argmax. With input ``greedy`` true the graph finds that
argmax in two stages and returns it as ``next_ids``, exactly:

    1. approximate logits with int8 weights (one int8 copy of the output embedding, a quarter of the bytes):
           s_a = range(h) / 255, z = round(-min(h) / s_a)      # uint8 activations, one scale per hidden row
           h_q = clip(round(h / s_a) + z, 0, 255)
           approx_v = s_a * s_v * (MatMulInteger(h_q, W_q)[v] - z * sum_i W_q[i, v])  # exact int32 sums
    2. a rigorous upper bound of every exact logit:
           |h . E_v - approx_v| <= |h|_1 * d_v + max_i |h_i - dq(h_q)_i| * |E^q_v|_1  (+ rounding slack,
                                                                                    SLACK_PER_K)
       where d_v = max_i |E_vi - E^q_vi| (measured at export) and the residual of the activations is
       computed in the graph from the quantised values themselves, so the bound holds whatever the rounding.
       upper_v = approx_v + bound_v.
    3. the C rows with the largest upper bounds are the candidates; their exact fp32 logits are computed
       from the fp32 embedding (a Gather of C rows and one small MatMul). If the best exact candidate logit m
       is above the C-th largest upper bound, no other row can reach m: the argmax is the candidate with
       logit m (the lowest id among equals, as ArgMax and NumPy pick).
    4. rows that the bound cannot certify fall back to the full fp32 Gemm and ArgMax, in the graph.
    5. in a fused graph each row also knows the token fed after it (the draft it verifies): a greedy round
       reads the argmax only up to the first rejected draft, so rows after one known to differ from its next
       token skip step 4 and read -2 (``next_tokens``; greedy acceptance never reaches them).

Worked example (C = 2, four vocabulary rows): approx = [5.0, 1.0, 4.6, 0.2], bound = 0.5 everywhere, so
upper = [5.5, 1.5, 5.1, 0.7]; candidates {0, 2} with exact logits [4.8, 5.0]; m = 5.0 > 1.5 (the largest
upper bound outside the candidates) -> next id 2. Had the exact logits been [4.8, 1.4], m = 4.8 would still
clear 1.5 -> id 0; with C = 1 and row 2's exact logit 5.0 > 4.8 the check 4.8 > 5.1 fails and the full Gemm
decides.

With ``greedy`` false the graph computes the full logits as before and ``next_ids`` is empty; with it true,
``logits`` is empty. A NaN or infinite hidden row gives id -1, which a Session turns into an error.
"""
from __future__ import annotations

import numpy as np

CANDIDATES = 128
"""Candidate rows per position. On 1,035 positions of SmolLM2-135M's greedy replies (code and chat) the bound
certifies 93.8 % with 64, 97.3 % with 128, 98.9 % with 256, alike in calls of one row and of five; after a
wrong token (a rejected draft's row) 16 %, 25 %, 37 %, which is why rows after a known rejection are not
answered (``next_tokens``)."""
MIN_SIZE = 1 << 22
"""Default on from this vocab x hidden (an fp32 LM head of 16 MiB) up, where the gain is clear: below it the
head's ~35 small nodes cost about what the Gemm they spare does (measured: docs/models.md, "The greedy head")."""
SLACK_PER_K = 2.0 ** -22
"""Rounding slack, times K * |h|_1 * max_i |E_vi| (K = hidden size): four times the worst-case fp32 rounding
(K * 2^-24 of sum_i |h_i E_vi|) of a dot product of length K, which covers the full Gemm's and the candidate
MatMul's errors against exact arithmetic (one each) and the scaled approximation's few roundings. So a
certified id is the argmax of the exactly computed logits; only candidates within that rounding of each other
(about 1e-5 of the logits' magnitude) may be ordered differently by the Gemm, as any two fp32 computations of
the logits may (ONNX Runtime's 5-row and 1-row passes differ by up to 4e-5)."""


def choose(plain_fp32: bool, vocab: int, hidden: int, asked: bool | None, candidates: int | None) -> tuple[bool, int]:
    """(whether a fused graph gets the head, its candidate count): ``asked`` None means where it pays
    (``MIN_SIZE``); it is built for float32 graphs without int4 only."""
    from rlxrt.errors import ExportError

    if asked and not plain_fp32:
        raise ExportError("the greedy head (next_ids) is built for float32 graphs without int4; drop --greedy-head "
                          "or export float32")
    count = int(candidates) if candidates is not None else min(CANDIDATES, vocab)
    if not 1 <= count <= vocab:
        raise ExportError(f"greedy_candidates {candidates}: 1..{vocab} (the vocabulary)")
    return (plain_fp32 and vocab * hidden >= MIN_SIZE) if asked is None else bool(asked), count


def int8_rows(e: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(W_q [K, V] int8, s [V], bound coefficients [2, V], and the row error d [V]) of the output embedding
    ``e`` [V, K]: symmetric per-row int8, s_v = max|E_v| / 127. Row 0 of the coefficients multiplies |h|_1,
    row 1 multiplies the activations' largest residual; both are rounded up."""
    e64 = e.astype(np.float64)
    emax = np.abs(e64).max(1)
    s = (emax / 127.0).astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1.0))
    q = np.clip(np.rint(e / safe[:, None]), -127, 127).astype(np.int8)
    eq = q.astype(np.float64) * s.astype(np.float64)[:, None]
    d = np.abs(e64 - eq).max(1)
    coef = np.stack([d + emax * e.shape[1] * SLACK_PER_K, np.abs(eq).sum(1) * (1 + 2.0 ** -10)])
    return np.ascontiguousarray(q.T), s, np.nextafter(coef.astype(np.float32), np.float32(np.inf)), d


def next_tokens(b) -> str:
    """[rows] int64: the token fed after each of the last ``num_logits`` rows of the fused graph being built by
    ``b`` (the draft that row verifies), -1 after the last one."""
    node, const = b.node, b.const
    start = node("Add", [node("Sub", [node("Shape", ["input_ids"], "fed_len", start=1), "num_logits"], "first_row"),
                         const("one", [1])], "first_fed")
    fed = node("Slice", [node("Reshape", ["input_ids", const("flat_ids", [-1])], "ids1d_in"), start,
                         const("end", [np.iinfo(np.int64).max]), const("axis0", [0])], "fed_after")
    return node("Concat", [fed, const("none_after", [-1])], "next_tokens", axis=0)


def add(b, flat: str, table: str, candidates: int = CANDIDATES, next_tokens: str | None = None) -> tuple[str, str]:
    """Add the greedy/sampling switch after ``flat`` ([rows, hidden], the normed rows asked for) to builder
    ``b``; ``table`` is the fp32 output embedding [V, hidden] already among its initializers. Returns the
    names of the [rows, V] logits and the [rows] ids (each empty in the other mode); it also writes the scalar
    ``greedy_fallbacks``, how many rows of the call took the full Gemm (0 when sampling).

    ``next_tokens`` ([rows] int64, the token fed after each row, -1 after the last) makes the ids a
    verification's: a greedy round reads the argmax of each row only up to the first row whose argmax differs
    from the token fed after it (the first rejected draft). Rows after a row known to differ — its certified id
    is another token, or the fed token's upper bound is below the row's best exact logit — skip the full Gemm
    and read -2 when the bound did not certify them. Without it every row is answered exactly."""
    from onnx import TensorProto

    from .fused import Nodes

    v = b.spec.vocab
    wq, s, coef, _ = int8_rows(b.take("model.embed_tokens.weight" if b.spec.tied else "lm_head.weight"))
    b.weight("greedy.wq", wq)
    b.weight("greedy.scale", s)
    b.weight("greedy.coef", coef)
    for name, value in (("greedy.axis_last", [-1]), ("greedy.c", [candidates]), ("greedy.c_last", [candidates - 1]),
                        ("greedy.vocab", v), ("greedy.none", -1), ("greedy.no_rows", [0, v]), ("greedy.no_ids", [0]),
                        *([("greedy.zero", 0), ("greedy.skipped", -2)] if next_tokens else [])):
        b.const(name, value)
    for name, value in (("greedy.tiny", 1e-30), ("greedy.f_zero", 0.0), ("greedy.q_hi", 255.0)):
        b.const(name, value, np.float32)
    b.weight("greedy.colsum", wq.astype(np.int32).sum(0).astype(np.int32))
    mk = b.helper

    def branch(name: str, build) -> object:
        g = Nodes()
        outs = build(g)
        vi = [mk.make_tensor_value_info(o, t, None) for o, t in outs]
        return mk.make_graph(g.nodes, name, [], vi)

    def greedy(g: Nodes):
        n = g.node
        # each row quantised on its own (one row's outlier must not coarsen the others): uint8 over the row's
        # range (0 included), zero point z; MatMulInteger's int32 sums are exact, z * sum_i W_vi taken off after
        lo = n("Min", [n("ReduceMin", [flat], "g.hmin0", axes=[-1], keepdims=1), "greedy.f_zero"], "g.hmin")
        hi = n("Max", [n("ReduceMax", [flat], "g.hmax0", axes=[-1], keepdims=1), "greedy.f_zero"], "g.hmax")
        hs = n("Div", [n("Max", [n("Sub", [hi, lo], "g.range0"), "greedy.tiny"], "g.range"), "greedy.q_hi"], "g.hs")
        hz = n("Round", [n("Div", [n("Neg", [lo], "g.neg_lo"), hs], "g.z0")], "g.hz")           # [rows, 1]
        hq = n("Cast", [n("Clip", [n("Add", [n("Round", [n("Div", [flat, hs], "g.hscaled")], "g.hround"), hz],
                                     "g.hshift"), "greedy.f_zero", "greedy.q_hi"], "g.hclip")], "g.hq", to=TensorProto.UINT8)
        shift = n("Mul", [n("Cast", [hz], "g.hz_i", to=TensorProto.INT32), "greedy.colsum"], "g.shift")
        acc = n("Sub", [n("MatMulInteger", [hq, "greedy.wq"], "g.acc0"), shift], "g.acc")
        approx = n("Mul", [n("Mul", [n("Cast", [acc], "g.accf", to=TensorProto.FLOAT), hs], "g.acc_s"),
                           "greedy.scale"], "g.approx")
        dq = n("Mul", [n("Sub", [n("Cast", [hq], "g.hqf", to=TensorProto.FLOAT), hz], "g.hq_c"), hs], "g.hdq")
        res = n("Abs", [n("Sub", [flat, dq], "g.res")], "g.ares")
        per_row = n("Concat", [n("ReduceL1", [flat], "g.hl1", axes=[-1], keepdims=1),
                               n("ReduceMax", [res], "g.rmax", axes=[-1], keepdims=1)], "g.per_row", axis=1)
        upper = n("Add", [approx, n("MatMul", [per_row, "greedy.coef"], "g.bound")], "g.upper")
        n("TopK", [upper, "greedy.c"], ["g.top_upper", "g.top_ids"], axis=-1)
        cand = n("Gather", [table, "g.top_ids"], "g.cand", axis=0)                  # [rows, C, hidden]
        exact = n("Squeeze", [n("MatMul", [cand, n("Unsqueeze", [flat, "greedy.axis_last"], "g.h3")], "g.ex3"),
                              "greedy.axis_last"], "g.exact")                        # [rows, C]
        best = n("ReduceMax", [exact], "g.best", axes=[-1], keepdims=1)
        threshold = n("Gather", ["g.top_upper", "greedy.c_last"], "g.threshold", axis=1)
        sure = n("Squeeze", [n("Greater", [best, threshold], "g.sure2"), "greedy.axis_last"], "g.sure")  # [rows]
        picked = n("ReduceMin", [n("Where", [n("Equal", [exact, best], "g.is_best"), "g.top_ids", "greedy.vocab"],
                                       "g.ids_or_v")], "g.picked", axes=[-1], keepdims=0)
        unsure = n("Not", [sure], "g.unsure")
        if next_tokens is not None:  # rows after one known to differ from the token fed after it are not read
            fed = n("Unsqueeze", [n("Max", [next_tokens, "greedy.zero"], "g.fed0"), "greedy.axis_last"], "g.fed")
            fed_upper = n("GatherElements", [upper, fed], "g.fed_upper", axis=1)         # [rows, 1]
            differs = n("Or", [n("And", [sure, n("Not", [n("Equal", [picked, next_tokens], "g.same")], "g.other")],
                                 "g.sure_other"),
                               n("Squeeze", [n("Less", [fed_upper, best], "g.fed_loses2"), "greedy.axis_last"], "g.fed_loses")], "g.differs")
            before = n("CumSum", [n("Cast", [differs], "g.differs_n", to=TensorProto.INT64), "greedy.zero"],
                       "g.differs_before", exclusive=1)
            read = n("Equal", [before, "greedy.zero"], "g.read")                      # [rows]
            picked = n("Where", [n("Or", [sure, read], "g.known"), picked, "greedy.skipped"], "g.picked_or_skip")
            unsure = n("And", [unsure, read], "g.unsure_read")
        # rows the bound could not certify (and that are read): the full Gemm, for those rows only
        n("ReduceSum", [n("Cast", [unsure], "g.unsure_n", to=TensorProto.INT64)], "g.fallbacks", keepdims=0)
        at = n("Transpose", [n("NonZero", [unsure], "g.unsure_at")], "g.unsure_idx")
        full = n("Gemm", [n("GatherND", [flat, at], "g.unsure_rows"), table], "g.full", transB=1)
        ids = n("ScatterND", [picked, at, n("ArgMax", [full], "g.full_ids", axis=1, keepdims=0)], "g.ids")
        row_sum = n("ReduceSum", [flat, "greedy.axis_last"], "g.row_sum", keepdims=0)
        broken = n("IsNaN", [n("Sub", [row_sum, row_sum], "g.nan_if_not_finite")], "g.broken")
        n("Where", [broken, "greedy.none", ids], "g.next_ids")
        n("ConstantOfShape", ["greedy.no_rows"], "g.no_logits", value=mk.make_tensor("z", TensorProto.FLOAT, [1], [0.0]))
        return [("g.no_logits", TensorProto.FLOAT), ("g.next_ids", TensorProto.INT64),
                ("g.fallbacks", TensorProto.INT64)]

    def sampling(g: Nodes):
        g.node("Gemm", [flat, table], "s.logits", transB=1)
        g.node("ConstantOfShape", ["greedy.no_ids"], "s.no_ids", value=mk.make_tensor("z", TensorProto.INT64, [1], [0]))
        g.node("Constant", [], "s.no_fallbacks", value=mk.make_tensor("z", TensorProto.INT64, [], [0]))
        return [("s.logits", TensorProto.FLOAT), ("s.no_ids", TensorProto.INT64), ("s.no_fallbacks", TensorProto.INT64)]

    b.node("If", ["greedy"], ["logits2d", "ids1d", "greedy_fallbacks"], then_branch=branch("greedy_ids", greedy),
           else_branch=branch("all_logits", sampling))
    return "logits2d", "ids1d"
