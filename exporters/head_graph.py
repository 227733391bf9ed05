"""The MTP head's graph, written by rlxrt from the head's weights (no torch exporter).

The same computation as the torch head (``mtp.build_head``) in about forty nodes, with ONNX Runtime's fused
ops where they exist::

    e      = RMSNorm(embedding[slot[input_ids]])                  # every fed position
    pre, v = split(e @ W_gate + b_gate)
    log a  = -softplus(-pre);  b = sigmoid(-pre) * v
    states = closed-form scan of s_t = a_t s_{t-1} + b_t          # [R, s, s] weights, lower triangle
    z      = [RMSNorm(h), e_last, state_last] @ W_z               # one MatMul for fuse and state_out
                                                                  # (h: each residual stream normalised too)
    (with attention: z at every position; k, v of each join the cache, and the last position's
     z = z_last + W_o softmax(q k^T / sqrt(d)) v, per head)
    z      = z + down(silu(gate) * up)(RMSNorm(z))
    hid    = RMSNorm(z);  logits = hid @ W_out                    # the last position only

A reduced head (N drafted tokens) reads each token's row through the slot map (row N for every other token)
and returns the logits of its N tokens alone (spreading them over the vocabulary, a Gather of V entries, had
cost more than the rest of a SmolLM2 head's step). ``quantize="int4"`` or ``"int8"`` stores the five
projection weights as MatMulNBits blocks of 4 or 8 bits computed at accuracy level 4 (int8 activations), and
``"int8"`` the input embedding as int8 rows with one scale each (a Gather of codes and of scales, then a Mul):
a draft's numbers need not match anything, since the acceptance rule uses the distribution the draft was
actually sampled from, so a cheap head stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .fused import MS, OPSET, Nodes, int4_blocks, int8_blocks

HEAD_INT4 = {"method": "MatMulNBits", "bits": 4, "block_size": 32, "symmetric": True, "accuracy_level": 4,
             "covers": "the head's projections and output layer; its input embedding stays float16"}
HEAD_INT8 = {"method": "MatMulNBits", "bits": 8, "block_size": 32, "symmetric": True, "accuracy_level": 4,
             "covers": "the head's projections and output layer; its input embedding is int8 with one scale a row"}
QUANTIZATION = {"int4": HEAD_INT4, "int8": HEAD_INT8}
"""How ``quantize`` stores a head's weights (recorded in its manifest)."""
CACHE = ("past_key.{i}", "past_value.{i}", "present_key.{i}", "present_value.{i}")
"""The attention layer's cache (a head with ``attention_heads``), [1, heads, L, head size]: the manifest's
patterns, and the graph's names with layer 0."""
PAST, PRESENT = tuple(n.format(i=0) for n in CACHE[:2]), tuple(n.format(i=0) for n in CACHE[2:])


def int8_rows(embed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes [E, H] int8 and scales [E, 1] float32 of an embedding: code = round(row / scale), scale = the row's
    largest |value| / 127 (1 for a row of zeros)."""
    scale = np.abs(embed).max(axis=1, keepdims=True).astype(np.float32) / 127
    scale[scale == 0] = 1.0
    return np.clip(np.rint(embed / scale), -127, 127).astype(np.int8), scale


@dataclass(frozen=True)
class HeadWeights:
    """The head's tensors as numpy float32, Linear weights as torch stores them ([out, in])."""

    embed: np.ndarray           # [E, H] input embedding (E = V, or N + 1 when reduced)
    out: np.ndarray             # [N, H] output rows (the embedding itself when tied)
    norms: dict                 # h, e, m, f -> [H]; x0, x1, ... for the residual streams it reads
    fuse: np.ndarray            # [H, 2H]
    gate_in: np.ndarray         # [2R, H]
    gate_bias: np.ndarray       # [2R]
    state_out: np.ndarray       # [H, R]
    up: np.ndarray              # [2I, H]
    down: np.ndarray            # [H, I]
    slot: np.ndarray | None     # [V] int64: each token's row (N outside the subset); None: full vocabulary
    eps: float
    attn: dict | None = None    # heads, norm [H], qkv [3H, H], o [H, H]: its attention layer (None: none)

    @classmethod
    def from_state_dict(cls, sd: dict, eps: float, attention_heads: int = 0) -> "HeadWeights":
        f = {k: v.detach().float().numpy() if hasattr(v, "detach") else np.asarray(v) for k, v in sd.items()}
        return cls(embed=f["embed"], out=f.get("unembed", f["embed"]),
                   norms={**{n: f[f"norm_{n}.weight"] for n in "hemf"},
                          **{f"x{i}": f[k] for i, k in enumerate(sorted((k for k in f if k.startswith("norm_x.")),
                                                                        key=lambda k: int(k.split(".")[1])))}},
                   fuse=f["fuse.weight"],
                   gate_in=f["gate_in.weight"], gate_bias=f["gate_in.bias"], state_out=f["state_out.weight"],
                   up=f["up.weight"], down=f["down.weight"],
                   slot=f["slot"].astype(np.int64) if "slot" in f else None, eps=eps,
                   attn={"heads": attention_heads, "norm": f["attn.norm"], "qkv": f["attn.qkv.weight"],
                         "o": f["attn.o.weight"]} if attention_heads else None)


class _Graph(Nodes):
    def __init__(self, quantize: str | None):
        super().__init__()
        self.spec = QUANTIZATION.get(quantize)

    def init(self, name: str, array: np.ndarray, half: bool = False) -> str:
        """An initializer; ``half`` stores a float one as float16 behind a Cast (ORT folds it at load)."""
        array = np.ascontiguousarray(array)
        if half and array.dtype == np.float32:
            from onnx import TensorProto

            self.inits.append(self.numpy_helper.from_array(array.astype(np.float16), name + "_fp16"))
            return self.node("Cast", [name + "_fp16"], name, to=TensorProto.FLOAT)
        self.inits.append(self.numpy_helper.from_array(array, name))
        return name

    def linear(self, x: str, w: np.ndarray, out: str) -> str:
        """x @ w.T for a Linear weight w [out, in]: MatMul (float16-stored) or MatMulNBits."""
        if not self.spec:
            return self.node("MatMul", [x, self.init(f"{out}.weight", w.T, half=True)], out)
        bits, block = self.spec["bits"], self.spec["block_size"]
        packed, scales = (int4_blocks if bits == 4 else int8_blocks)(w.T, block)
        return self.node("MatMulNBits", [x, self.init(f"{out}.q{bits}", packed), self.init(f"{out}.scales", scales)],
                         out, domain=MS, K=w.shape[1], N=w.shape[0], bits=bits, block_size=block,
                         accuracy_level=self.spec["accuracy_level"])

    def embedding(self, embed: np.ndarray, ids: str) -> str:
        """The rows of ``ids``: float16-stored, or int8 codes times their row's scale under int8."""
        if not self.spec or self.spec["bits"] != 8:
            return self.node("Gather", [self.init("embed", embed, half=True), ids], "embedded")
        from onnx import TensorProto

        codes, scales = int8_rows(embed)
        rows = self.node("Cast", [self.node("Gather", [self.init("embed.q8", codes), ids], "embedded_q8")],
                         "embedded_codes", to=TensorProto.FLOAT)
        return self.node("Mul", [rows, self.node("Gather", [self.init("embed.scales", scales), ids], "row_scales")],
                         "embedded")

    def norm(self, x: str, w: np.ndarray, name: str, eps: float) -> str:
        return self.node("SimplifiedLayerNormalization", [x, self.init(f"{name}.weight", w)], name, axis=-1,
                         epsilon=eps, stash_type=1)


def build_head_graph(w: HeadWeights, path: Path, quantize: str | None = None) -> None:
    """Write the head's graph to ``path`` (inputs and outputs as ``mtp.INPUTS``/``mtp.OUTPUTS``)."""
    import onnx
    from onnx import TensorProto

    g, eps = _Graph(quantize), w.eps
    H, R = w.embed.shape[1], w.state_out.shape[1]
    ids = "input_ids" if w.slot is None else g.node("Gather", [g.init("slot", w.slot), "input_ids"], "rows")
    e = g.norm(g.embedding(w.embed, ids), w.norms["e"], "e", eps)
    g.node("Split", [g.linear(e, w.gate_in, "gate_mm"), g.init("halves", np.array([R, R], np.int64))],
           ["pre", "v"], axis=-1)
    # (the bias is added before the split in torch; adding each half's bias after it is the same sum)
    pre = g.node("Add", ["pre", g.init("bias_a", w.gate_bias[:R])], "pre_b")
    v = g.node("Add", ["v", g.init("bias_v", w.gate_bias[R:])], "v_b")
    neg = g.node("Neg", [pre], "neg_pre")
    log_a = g.node("Neg", [g.node("Softplus", [neg], "softplus")], "log_a")            # [1, s, R]
    b = g.node("Mul", [g.node("Sigmoid", [neg], "one_minus_a"), v], "b")               # [1, s, R]
    states = _scan(g, log_a, b)                                                        # [1, s, R]
    g.node("Reshape", [states, g.init("rows_r", np.array([-1, R], np.int64))], "states")
    last = g.init("last", np.array([-1], np.int64))
    end, axis1 = g.init("end", np.array([np.iinfo(np.int64).max], np.int64)), g.init("axis1", np.array([1], np.int64))
    P = sum(1 for k in w.norms if k.startswith("x"))  # residual streams read beside the last hidden state
    if P:  # [h | x0 | x1 ...]: each part normalised alone
        g.node("Split", ["hidden_states", g.init("parts", np.array([H] * (1 + P), np.int64))],
               ["hidden_last"] + [f"stream{i}" for i in range(P)], axis=-1)
        parts = [g.norm("hidden_last", w.norms["h"], "h", eps)] + \
            [g.norm(f"stream{i}", w.norms[f"x{i}"], f"x{i}", eps) for i in range(P)]
    else:
        parts = [g.norm("hidden_states", w.norms["h"], "h", eps)]
    if w.attn is None:  # the last position alone
        e_last = g.node("Slice", [e, last, end, axis1], "e_last")
        s_last = g.node("Slice", [states, last, end, axis1], "state_last")
        cat = g.node("Concat", [*parts, e_last, s_last], "mix_in", axis=-1)            # [1, 1, (2 + P)H + R]
        z = g.linear(cat, np.concatenate([w.fuse, w.state_out], axis=1), "z")
    else:  # every position: its keys and values join the cache, the last one's query reads them
        cat = g.node("Concat", [*parts, e, states], "mix_in", axis=-1)                 # [1, s, (2 + P)H + R]
        z_all = g.linear(cat, np.concatenate([w.fuse, w.state_out], axis=1), "z_all")
        z = _attention(g, z_all, w.attn, eps, (last, end, axis1))
    gu = g.linear(g.norm(z, w.norms["m"], "m", eps), w.up, "gate_up")
    g.node("Split", [gu, g.init("mlp_halves", np.array([w.up.shape[0] // 2] * 2, np.int64))],
           ["mlp_gate", "mlp_up"], axis=-1)
    silu = g.node("Mul", ["mlp_gate", g.node("Sigmoid", ["mlp_gate"], "sig")], "silu")
    act = g.node("Mul", [silu, "mlp_up"], "act")
    down = g.linear(act, w.down, "down")
    own_hidden = "hidden_own" if P else "hidden_out"
    g.node("SkipSimplifiedLayerNormalization", [down, z, g.init("f.weight", w.norms["f"])], own_hidden,
           domain=MS, epsilon=eps)
    if P:  # as wide as the input: its own state, then zeros where a target's streams would be
        g.node("Concat", [own_hidden, g.init("no_streams", np.zeros((1, 1, P * H), np.float32))], "hidden_out",
               axis=-1)
    g.linear(own_hidden, w.out, "logits")  # a reduced head's N tokens alone (the manifest's draft_vocab)
    h_ = g.helper
    inputs = [h_.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"]),
              h_.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [1, 1 if w.attn is None else "s", H * (1 + P)]),
              h_.make_tensor_value_info("state", TensorProto.FLOAT, [R])]
    outputs = [h_.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1, w.out.shape[0]]),
               h_.make_tensor_value_info("hidden_out", TensorProto.FLOAT, [1, 1, H * (1 + P)]),
               h_.make_tensor_value_info("states", TensorProto.FLOAT, ["s", R])]
    if w.attn is not None:
        kv = [w.attn["heads"], H // w.attn["heads"]]
        inputs += [h_.make_tensor_value_info(n, TensorProto.FLOAT, [1, kv[0], "past", kv[1]]) for n in PAST]
        outputs += [h_.make_tensor_value_info(n, TensorProto.FLOAT, [1, kv[0], "total", kv[1]]) for n in PRESENT]
    graph = h_.make_graph(g.nodes, "rlxrt_mtp_head", inputs, outputs, g.inits)
    model = h_.make_model(graph, opset_imports=[h_.make_opsetid("", OPSET), h_.make_opsetid(MS, 1)], ir_version=10,
                          producer_name="rlxrt")
    onnx.save(model, str(path))


def _attention(g: _Graph, z_all: str, a: dict, eps: float, last_slice: tuple) -> str:
    """The last position's input plus its attention over the cache and the fed positions (``head_attention``):
    keys and values of every fed position are appended to ``past_key``/``past_value`` ([1, heads, L, d])."""
    H = a["norm"].shape[0]
    n, d = a["heads"], H // a["heads"]
    x = g.norm(z_all, a["norm"], "a", eps)
    kv = g.linear(x, a["qkv"][H:], "kv")
    g.node("Split", [kv, g.init("kv_halves", np.array([H, H], np.int64))], ["k_new", "v_new"], axis=-1)
    split = g.init("by_head", np.array([1, -1, n, d], np.int64))
    for new, past, present in zip(("k_new", "v_new"), PAST, PRESENT):
        heads = g.node("Transpose", [g.node("Reshape", [new, split], f"{new}_4d")], f"{new}_t", perm=[0, 2, 1, 3])
        g.node("Concat", [past, heads], present, axis=2)                                   # [1, n, L + s, d]
    q = g.linear(g.node("Slice", [x, *last_slice], "x_last"), a["qkv"][:H], "q")
    q = g.node("Transpose", [g.node("Reshape", [q, split], "q_4d")], "q_t", perm=[0, 2, 1, 3])   # [1, n, 1, d]
    scores = g.node("FusedMatMul", [q, PRESENT[0]], "scores", domain=MS, transB=1, alpha=1 / float(np.sqrt(d)))
    y = g.node("MatMul", [g.node("Softmax", [scores], "weights", axis=-1), PRESENT[1]], "attended")
    y = g.node("Reshape", [g.node("Transpose", [y], "attended_t", perm=[0, 2, 1, 3]),
                           g.init("one_row", np.array([1, 1, H], np.int64))], "attended_row")
    z_last = g.node("Slice", [z_all, *last_slice], "z_last")
    return g.node("Add", [z_last, g.linear(y, a["o"], "attn_out")], "z")


def _scan(g: _Graph, log_a: str, b: str) -> str:
    """The states [1, s, R] after each position, in closed form (``scan.closed_form_scan``) laid out as
    [1, R, t, u] so that the causal mask is a Trilu (a batched MatMul for the sum over u costs more than Mul and
    ReduceSum at these sizes)."""
    s_cum = g.node("CumSum", [g.node("Transpose", [log_a], "log_a_t", perm=[0, 2, 1]),
                              g.init("axis2", np.array(2, np.int64))], "cum")                  # [1, R, s]
    diff = g.node("Sub", [g.node("Unsqueeze", [s_cum, g.init("ax3", np.array([3], np.int64))], "cum_t"),
                          g.node("Unsqueeze", [s_cum, g.init("ax2", np.array([2], np.int64))], "cum_u")], "diff")
    weights = g.node("Trilu", [g.node("Exp", [diff], "decay")], "decay_causal", upper=0)  # [1, R, t, u]
    b_u = g.node("Unsqueeze", [g.node("Transpose", [b], "b_t", perm=[0, 2, 1]), "ax2"], "b_u")  # [1, R, 1, u]
    summed = g.node("ReduceSum", [g.node("Mul", [weights, b_u], "terms"), "ax3"], "summed_s", keepdims=0)
    start = g.node("Mul", [g.node("Exp", [s_cum], "decay0"),
                           g.node("Unsqueeze", ["state", g.init("ax01", np.array([0, 2], np.int64))], "s0")],
                   "from_s0")                                                                   # [1, R, s]
    total = g.node("Add", [summed, start], "states_t")
    return g.node("Transpose", [total], "states_all", perm=[0, 2, 1])
