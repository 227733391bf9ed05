"""The fused decoder graph of a Llama-style model (llama, mistral, qwen2, qwen3), built from its weights.

No torch: the weights are read from safetensors with numpy and the graph is written with onnx helpers.
One block per layer, as ONNX Runtime's contrib ops fuse it:

    x = Gather(embedding, input_ids)
    n = SimplifiedLayerNormalization(x)                         # RMSNorm
    per layer:
        qkv  = MatMul(n, W_qkv) (+ bias)                        # q, k, v packed in one weight
        attn = GroupQueryAttention(qkv, past_k, past_v, seqlens_k, total_sequence_length, cos, sin)
        n, r = SkipSimplifiedLayerNormalization(attn @ W_o, r)  # residual add + RMSNorm in one op
        gate, up = MatMul(n, W_gate), MatMul(n, W_up)
        n, r = SkipSimplifiedLayerNormalization((silu(gate) * up) @ W_down, r)
    logits = Gemm(last num_logits rows of n, embedding^T)       # only the rows the caller needs

The KV cache is one buffer per tensor of a fixed capacity, [1, kv_heads, capacity, head_dim], bound as
both past and present: GroupQueryAttention writes the new keys/values at positions
seqlens_k + 1 - S .. seqlens_k and attends causally over 0 .. seqlens_k, rotary applied inside at those
positions. A rollback is only a shorter committed length in the next call.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from rlxrt.errors import ExportError
from rlxrt.manifest import KVCacheLayout

from .gguf_blocks import Blocks

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
TASK = "text-generation-fused"
OPSET, MS = 17, "com.microsoft"
PAST = ("past_key_values.{i}.key", "past_key_values.{i}.value", "present.{i}.key", "present.{i}.value")
INPUTS = {"input_ids": "input_ids", "seqlens_k": "seqlens_k", "total_sequence_length": "total_sequence_length",
          "num_logits": "num_logits", "attention_mask": None, "position_ids": None}


def _rope(config: dict) -> tuple[float, dict | None]:
    """rope theta and scaling, from transformers 4's ``rope_theta``/``rope_scaling`` or 5's ``rope_parameters``."""
    params = config.get("rope_parameters") or {}
    theta = float(config.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return theta, scaling or None


def unsupported(config: dict) -> str | None:
    """Why the fused graph cannot be built for this config.json (None: it can), checked before any weight
    is read, so the automatic choice falls back to the portable graph instead of failing."""
    if config.get("model_type") not in FAMILIES:
        return f"the fused graph covers {', '.join(FAMILIES)}, not model type {config.get('model_type')!r}"
    heads = int(config.get("num_attention_heads") or 1)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // heads)
    if head_dim % 16:
        return f"ONNX Runtime's GroupQueryAttention needs a head size that is a multiple of 16, this model's is {head_dim}"
    scaling = _rope(config)[1]
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        return f"rope scaling {kind!r} is not built into the fused graph (default, linear, llama3)"
    if config.get("mlp_bias"):
        return "mlp_bias is not built into the fused graph"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config.get('hidden_act')!r} is not built into the fused graph (silu only)"
    return None


INT4 = {"method": "MatMulNBits", "bits": 4, "block_size": 32, "symmetric": True, "accuracy_level": 0,
        "activations": "float32", "rows_alike": "on every kernel set (float32 arithmetic)",
        "exactness": "speculative output equals plain output of THIS quantised graph, not of the fp32 model"}
"""How ``--quantize int4`` stores the MatMul weights (recorded in the manifest): blockwise symmetric int4
along K, blocks of 32, one float scale per block; the embedding lookup stays fp32. Accuracy level 0
(fp32 compute), so that a (k+1)-row verification equals one-row steps and speculation stays exact."""
INT4_INT8 = {**INT4, "accuracy_level": 4, "activations": "int8, per row and block of 32",
             "rows_alike": "on rlxrt's CPU kernels only (cpu_kernels = rlxrt, or auto where they run AVX-512 VNNI)",
             "exactness": "speculative output equals plain output of THIS graph where rlxrt's CPU kernels run it; "
                          "on ONNX Runtime's kernels a Session refuses a speculator on it"}
"""``--int4-compute int8``: the same weights computed at accuracy level 4 (int8 activations), faster plain
decoding (docs/models.md). ONNX Runtime computes k+1 rows and one row differently at this level (logits up to
0.5 apart), so speculation over it
there would not be exact and a Session refuses it (``backends/rows.py``); rlxrt's CPU kernels compute a row
the same alone or in a verification, and speculate over it exactly. Any such graph may draft for another
target (a draft's numbers do not touch exactness)."""


INT8 = {"method": "MatMulNBits", "bits": 8, "block_size": 32, "symmetric": True, "accuracy_level": 4,
        "activations": "int8, per row and block of 32",
        "rows_alike": "on rlxrt's CPU kernels only (cpu_kernels = rlxrt, or auto where they run AVX-512 VNNI)",
        "exactness": "speculative output equals plain output of THIS quantised graph where rlxrt's CPU kernels run "
                     "it (rows_exact); on ONNX Runtime's kernels a Session refuses a speculator on it"}
"""How ``--quantize int8`` stores a fused graph's MatMul weights: blockwise symmetric 8-bit codes along K
(code = round(w / scale) + 128, scale = max |w| of the block / 127), blocks of 32, computed with int8
activations (accuracy level 4) — a quarter of float32's bytes, about 1e-2 of the logits' scale away from it.
Made for drafts: a draft's numbers never touch the target's exactness, and the shipped 1-layer draft in 8 bits
proposes what it proposes in float32 (argmax agreement 1.00 at validation) at 0.6 of the step time."""


def check_int4_compute(int4_compute: str, int4: bool) -> None:
    if int4_compute not in ("fp32", "int8") or (int4_compute == "int8" and not int4):
        raise ExportError(f"int4_compute {int4_compute!r}: fp32 (the default) or int8, and int8 only with "
                          "quantize int4")


def _symmetric_blocks(w: np.ndarray, block: int, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes [N, blocks, block] (uint8, zero point top + 1) and scales [N * blocks] of ``w`` [K, N], blocks
    along K: code = round(w / scale) + top + 1, scale = max |w| of the block / top."""
    k, n = w.shape
    blocks = -(-k // block)
    padded = np.zeros((blocks * block, n), np.float32)
    padded[:k] = w
    wb = padded.T.reshape(n, blocks, block)
    scale = np.abs(wb).max(-1) / float(top)
    safe = np.where(scale > 0, scale, 1.0)
    q = (np.clip(np.rint(wb / safe[..., None]), -top - 1, top) + top + 1).astype(np.uint8)
    return q, scale.astype(np.float32).reshape(-1)


def int4_blocks(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' packed weight [N, blocks, block/2] (uint8, two 4-bit codes a byte, low nibble first) and
    scales [N * blocks] of ``w`` [K, N]: code = round(w / scale) + 8, scale = max |w| of the block / 7."""
    q, scales = _symmetric_blocks(w, block, 7)
    return q[..., 0::2] | (q[..., 1::2] << 4), scales


def int8_blocks(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' 8-bit weight [N, blocks, block] (uint8, zero point 128) and scales [N * blocks] of ``w``
    [K, N]: code = round(w / scale) + 128, scale = max |w| of the block / 127."""
    return _symmetric_blocks(w, block, 127)


MAX_CAPACITY = 1 << 20
"""Positions of a fused graph's KV buffer at most (its rotary tables and each session's buffers hold them all)."""


class Spec:
    """The numbers of a Llama-style config.json the graph needs."""

    def __init__(self, config: dict, capacity: int | None, quantize: str | None = None, dtype: str = "float32",
                 int4_compute: str = "fp32", greedy_head: bool | None = None, greedy_candidates: int | None = None,
                 vocab_ids: np.ndarray | None = None):
        why_not = unsupported(config)
        if why_not:
            raise ExportError(f"{why_not}; export with --graph portable")
        c = config
        self.model_type = c["model_type"]
        self.hidden, self.layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
        self.heads = int(c["num_attention_heads"])
        self.kv_heads = int(c.get("num_key_value_heads") or self.heads)
        self.head_dim = int(c.get("head_dim") or self.hidden // self.heads)
        self.intermediate, self.vocab = int(c["intermediate_size"]), int(c["vocab_size"])
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        self.theta, self.rope_scaling = _rope(c)
        self.tied = bool(c.get("tie_word_embeddings", False))
        self.qkv_bias = self.model_type == "qwen2" or bool(c.get("attention_bias", False))
        self.qk_norm = self.model_type == "qwen3"
        """Qwen3 normalises each head of q and k (RMSNorm over head_dim) before the rotary embedding."""
        self.o_bias = self.model_type != "qwen2" and bool(c.get("attention_bias", False))
        max_pos = int(c.get("max_position_embeddings") or 2048)
        self.capacity = int(capacity) if capacity else max_pos
        if not 1 <= self.capacity <= max_pos:
            raise ExportError(f"--max-context {capacity} is outside 1..{max_pos} (the model's max positions)")
        if self.capacity > MAX_CAPACITY:  # its rotary tables and every session's KV buffers are this long
            raise ExportError(f"the model claims {max_pos} positions; a fused graph holds at most {MAX_CAPACITY}: "
                              "pass --max-context N (the longest prompt plus reply it must serve)")
        self.windows = [self._window(c, i) for i in range(self.layers)]
        """Per layer: GroupQueryAttention's local_window_size (-1: full attention)."""
        if quantize not in (None, "int4", "int8"):
            raise ExportError(f"the fused graph quantises to int4 or int8, not {quantize!r}")
        if dtype not in ("float32", "float16") or (dtype == "float16" and quantize):
            raise ExportError(f"the fused graph computes in float32 or float16 (without int4), not {dtype!r}")
        self.bits = {"int4": 4, "int8": 8}.get(quantize)
        """MatMulNBits' bits of the MatMul weights (None: float MatMuls)."""
        check_int4_compute(int4_compute, self.bits == 4)
        self.quantization = (INT8 if self.bits == 8 else INT4_INT8 if int4_compute == "int8" else INT4) \
            if self.bits else None
        self.dtype = dtype
        """What the graph computes in and keeps its cache in; logits and hidden states leave it as float32."""
        self.vocab_ids = vocab_ids
        """A draft-only graph's N tokens (``draft_vocab.py``): its logits are theirs alone, [1, rows, N]."""
        self.width = self.vocab if vocab_ids is None else len(vocab_ids)
        if vocab_ids is not None and greedy_head:
            raise ExportError("the greedy head reads a target's whole vocabulary, and --draft-vocab makes a draft: "
                              "drop one of them")
        from .greedy_head import choose

        self.greedy_head, self.greedy_candidates = choose(dtype == "float32" and not self.bits and vocab_ids is None,
                                                          self.vocab, self.hidden, greedy_head, greedy_candidates)
        """Input ``greedy`` and output ``next_ids``: the exact argmax through int8 candidates (greedy_head.py);
        by default where the LM head is large enough to pay for it (``greedy_head.MIN_SIZE``)."""

    def _window(self, c: dict, i: int) -> int:
        """transformers' sliding window of layer i: mistral on every layer (4096 when unset); qwen2 only when
        use_sliding_window, from max_window_layers on (or as layer_types says). ORT counts the current token
        in the window, as transformers does."""
        types = c.get("layer_types")
        if types:
            sliding = types[i] == "sliding_attention"
        elif self.model_type == "mistral":
            sliding = True
        else:
            sliding = bool(c.get("use_sliding_window")) and i >= int(c.get("max_window_layers", 0) or 0)
        window = c.get("sliding_window", 4096 if self.model_type == "mistral" else None)
        return int(window) if sliding and window and int(window) < self.capacity else -1

    def kv_layout(self) -> KVCacheLayout:
        return KVCacheLayout(self.layers, self.kv_heads, self.head_dim, self.dtype, *PAST, capacity=self.capacity)


def rotary_caches(spec: Spec) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [capacity, head_dim / 2] of rotate-half rotary embeddings, with Llama-3/linear scaling."""
    d = spec.head_dim
    inv_freq = 1.0 / spec.theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    pos = np.arange(spec.capacity, dtype=np.float64)
    s = spec.rope_scaling
    kind = (s or {}).get("rope_type", (s or {}).get("type", "default"))
    if kind == "linear":
        pos = pos / float(s["factor"])
    elif kind == "llama3":
        factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - low) / (high - low)
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        inv_freq = np.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind != "default":
        raise ExportError(f"rope scaling {kind!r} is not supported by the fused graph (default, linear, llama3); "
                          "export with --graph portable")
    angles = np.outer(pos, inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class Nodes:
    """The nodes and initializers of a graph being written (this builder's and the MTP head's)."""

    def __init__(self):
        from onnx import helper, numpy_helper

        self.helper, self.numpy_helper = helper, numpy_helper
        self.nodes, self.inits = [], []

    def node(self, op: str, inputs: list[str], outputs: list[str] | str, domain: str = "", **attrs) -> str:
        """Add one node; returns (the first of) its output name(s)."""
        outs = [outputs] if isinstance(outputs, str) else outputs
        self.nodes.append(self.helper.make_node(op, inputs, outs, name=f"{op}_{len(self.nodes)}", domain=domain,
                                                **attrs))
        return outs[0]


class Builder(Nodes):
    """Collects nodes and initializers; each method adds one block and returns its output name."""

    def __init__(self, spec: Spec, weights: dict[str, np.ndarray], blocks: dict | None = None):
        super().__init__()
        self.spec, self.w, self.consts = spec, weights, set()
        self.blocks = blocks or {}
        """A GGUF's own blocks by weight name (``gguf_blocks.matched``), used instead of quantising."""
        self.stored: dict[str, str] = {}
        """How each weight of an int4 graph from a GGUF is stored: its block type, float32, or int4 quantised here."""

    def weight(self, name: str, array: np.ndarray) -> str:
        """An initializer; float weights are stored in the graph's compute type."""
        if array.dtype == np.float32 and self.spec.dtype == "float16":
            array = array.astype(np.float16)
        self.inits.append(self.numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def to_float32(self, x: str, out: str) -> str:
        """``x`` as float32 under the name ``out`` (a Cast only when the graph computes in float16)."""
        from onnx import TensorProto

        if self.spec.dtype == "float32":
            return self.node("Identity", [x], out) if x != out else out
        return self.node("Cast", [x], out, to=TensorProto.FLOAT)

    def const(self, name: str, values, dtype=np.int64) -> str:
        """A constant initializer, made once however many blocks use ``name``."""
        if name not in self.consts:
            self.consts.add(name)
            self.weight(name, np.asarray(values, dtype))
        return name

    def take(self, name: str) -> np.ndarray:
        if name not in self.w:
            raise ExportError(f"the weights have no tensor {name!r}; is this a {self.spec.model_type} checkpoint?")
        return self.w[name]

    def matmul(self, x: str, w: np.ndarray, out: str) -> str:
        """x @ w for w [K, N]: MatMul, or MatMulNBits over its 4- or 8-bit blocks."""
        if not self.spec.bits:
            return self.node("MatMul", [x, self.weight(f"{out}.weight", w)], out)
        packed, scales = (int8_blocks if self.spec.bits == 8 else int4_blocks)(w, INT4["block_size"])
        return self.nbits(x, packed, scales, w.shape[0], out, self.spec.bits)

    def nbits(self, x: str, packed: np.ndarray, scales: np.ndarray, k: int, out: str, bits: int = 4) -> str:
        return self.node("MatMulNBits", [x, self.weight(f"{out}.q{bits}", packed),
                                         self.weight(f"{out}.scales", scales)],
                         out, domain=MS, K=k, N=packed.shape[0], bits=bits, block_size=INT4["block_size"],
                         accuracy_level=self.spec.quantization["accuracy_level"])

    def store(self, keys: list[str], b) -> str:
        """How weights ``keys`` (stacked blocks ``b``, or None) go into an int4 graph: "blocks" (the GGUF's
        own), "float32" (8-bit blocks at accuracy level 0) or "int4" (quantised here); recorded in ``stored``."""
        if not self.spec.bits:
            return "float"
        how = "int4" if b is None else "blocks" if b.bits == 4 or self.spec.quantization["accuracy_level"] == 4 \
            else "float32"
        if self.blocks:
            for k in keys:
                self.stored[k] = self.blocks[k].kind if how == "blocks" else how
        return how

    def gguf_matmul(self, x: str, b, out: str) -> str:
        """x @ W^T for a GGUF's own blocks ``b`` (W [N, K]): MatMulNBits computes scale * (code - zero); a
        Q4_1 block's shift (m + 8 d) adds the block sums of x times the shifts, a [blocks, N] MatMul."""
        blocks = b.scale.shape[1]
        packed = b.codes if b.bits == 8 else b.codes[..., 0::2] | (b.codes[..., 1::2] << 4)
        y = self.nbits(x, packed, b.scale.reshape(-1), blocks * INT4["block_size"],
                       out if b.shift is None else f"{out}.q", b.bits)
        if b.shift is None:
            return y
        sums = f"{x}.block_sums"
        if sums not in self.consts:  # once per input (gate and up read the same one)
            self.consts.add(sums)
            shape = self.const(f"blocks{blocks}", [0, 0, blocks, INT4["block_size"]])
            split = self.node("Reshape", [x, shape], f"{x}.blocks")
            self.node("ReduceSum", [split, self.const("axis_last", [-1])], sums, keepdims=0)
        shift = self.node("MatMul", [sums, self.weight(f"{out}.shift", np.ascontiguousarray(b.shift.T))], f"{out}.s")
        return self.node("Add", [y, shift], out)

    def linear(self, x: str, names: list[str], out: str, bias: bool = False) -> str:
        """x @ W^T for one or several HF Linear weights [out, in] packed side by side."""
        keys, y = [f"{n}.weight" for n in names], f"{out}.mm" if bias else out
        b = Blocks.stack([self.blocks[k] for k in keys]) if all(k in self.blocks for k in keys) else None
        how = self.store(keys, b)
        if how == "blocks":
            y = self.gguf_matmul(x, b, y)
        else:
            w = np.concatenate([self.take(k) for k in keys], axis=0).T
            # 8-bit GGUF weights at accuracy level 0 stay float32 (see gguf_blocks)
            y = self.node("MatMul", [x, self.weight(f"{y}.weight", w)], y) if how == "float32" else \
                self.matmul(x, w, y)
        if bias:
            b = np.concatenate([self.take(f"{n}.bias") for n in names])
            y = self.node("Add", [y, self.weight(f"{out}.bias", b)], out)
        return y

    def attention(self, i: int, x: str) -> str:
        s, p = self.spec, f"model.layers.{i}.self_attn"
        qkv = self.linear(x, [f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"], f"l{i}.qkv", bias=s.qkv_bias)
        q, k, v = (qkv, "", "") if not s.qk_norm else self.head_norms(i, qkv)
        past_k, past_v, present_k, present_v = (n.format(i=i) for n in PAST)
        out = self.node("GroupQueryAttention",
                        [q, k, v, past_k, past_v, "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"],
                        [f"l{i}.attn", present_k, present_v], domain=MS, num_heads=s.heads, kv_num_heads=s.kv_heads,
                        scale=1.0 / math.sqrt(s.head_dim), do_rotary=1, rotary_interleaved=0,
                        local_window_size=s.windows[i])
        return self.linear(out, [f"{p}.o_proj"], f"l{i}.o", bias=s.o_bias)

    def head_norms(self, i: int, qkv: str) -> tuple[str, str, str]:
        """Qwen3's q_norm and k_norm: the packed projection split into q, k, v, and q and k normalised per
        head (RMSNorm over head_dim, one weight shared by the heads); rotary stays inside the attention op."""
        s, p = self.spec, f"model.layers.{i}.self_attn"
        sizes = [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim]
        q, k, v = (f"l{i}.{n}" for n in "qkv")
        self.node("Split", [qkv, self.const(f"l{i}.qkv_sizes", sizes)], [q, k, v], axis=-1)
        per_head, flat = self.const("per_head", [0, 0, -1, s.head_dim]), self.const("heads_flat", [0, 0, -1])
        out = []
        for name, x in (("q_norm", q), ("k_norm", k)):
            heads = self.node("Reshape", [x, per_head], f"l{i}.{name}.in")
            w = self.weight(f"{p}.{name}.weight", self.take(f"{p}.{name}.weight"))
            normed = self.node("SimplifiedLayerNormalization", [heads, w], f"l{i}.{name}.out", axis=-1,
                               epsilon=s.eps, stash_type=1)
            out.append(self.node("Reshape", [normed, flat], f"l{i}.{name}"))
        return out[0], out[1], v

    def mlp(self, i: int, x: str) -> str:
        p = f"model.layers.{i}.mlp"
        gate = self.linear(x, [f"{p}.gate_proj"], f"l{i}.gate")  # two MatMuls: cheaper than one + Split
        up = self.linear(x, [f"{p}.up_proj"], f"l{i}.up")
        silu = self.node("Mul", [gate, self.node("Sigmoid", [gate], f"l{i}.sig")], f"l{i}.silu")
        return self.linear(self.node("Mul", [silu, up], f"l{i}.act"), [f"{p}.down_proj"], f"l{i}.down")

    def skip_norm(self, x: str, residual: str, weight: str, name: str, out: str | None = None) -> tuple[str, str]:
        """(RMSNorm(x + residual), x + residual); ``out`` names the first output."""
        w = self.weight(f"{name}.weight", self.take(weight))
        out = out or f"{name}.out"
        self.node("SkipSimplifiedLayerNormalization", [x, residual, w], [out, "", "", f"{name}.sum"],
                  domain=MS, epsilon=self.spec.eps)
        return out, f"{name}.sum"

    def logits(self, hidden: str) -> str:
        """Logits of the last ``num_logits`` rows only: [1, rows, vocab]."""
        s = self.spec
        rows = self.node("Slice", [hidden, self.node("Neg", ["num_logits"], "neg_rows"),
                                   self.const("end", [np.iinfo(np.int64).max]), self.const("axis1", [1])], "rows")
        if s.vocab_ids is not None:
            return self.draft_logits(rows)
        if s.bits:  # MatMulNBits takes [1, rows, H]; the lookup keeps its fp32 embedding
            name = "model.embed_tokens.weight" if s.tied else "lm_head.weight"
            b = self.blocks.get(name)
            how = self.store([name], b)
            if how == "int4":
                return self.matmul(rows, self.take(name).T, "logits")
            if how == "blocks":
                return self.gguf_matmul(rows, b, "logits")
        flat = self.node("Reshape", [rows, self.const("flat", [-1, s.hidden])], "rows2d")
        if s.bits:  # an 8-bit GGUF weight at accuracy level 0: float32, not a coarser int4 copy
            out = self.node("Gemm", [flat, "embed.weight"], "logits2d", transB=1) if s.tied else \
                self.node("MatMul", [flat, self.weight("lm_head.weight", self.take(name).T)], "logits2d")
            return self.node("Unsqueeze", [out, self.const("axis0", [0])], "logits")
        last = "logits" if s.dtype == "float32" else "logits.compute"
        if s.greedy_head:
            from .greedy_head import add, next_tokens

            table = "embed.weight" if s.tied else self.weight("lm_head.rows", self.take("lm_head.weight"))
            out, ids = add(self, flat, table, s.greedy_candidates, next_tokens(self))
            self.node("Unsqueeze", [ids, self.const("axis0", [0])], "next_ids")
            return self.node("Unsqueeze", [out, self.const("axis0", [0])], "logits")
        if s.tied:
            out = self.node("Gemm", [flat, "embed.weight"], "logits2d", transB=1)
        else:
            out = self.node("MatMul", [flat, self.weight("lm_head.weight", self.take("lm_head.weight").T)], "logits2d")
        return self.to_float32(self.node("Unsqueeze", [out, self.const("axis0", [0])], last), "logits")

    def draft_logits(self, rows: str) -> str:
        """The logits of a draft-only graph's N tokens: its own copy of their LM head rows, [N, H]."""
        s = self.spec
        name = "model.embed_tokens.weight" if s.tied else "lm_head.weight"
        table = self.take(name)[s.vocab_ids]
        if s.bits:
            if self.blocks:
                self.stored[name] = "int4"
            return self.matmul(rows, np.ascontiguousarray(table.T), "logits")
        flat = self.node("Reshape", [rows, self.const("flat", [-1, s.hidden])], "rows2d")
        out = self.node("Gemm", [flat, self.weight("lm_head.draft", table)], "logits2d", transB=1)
        last = "logits" if s.dtype == "float32" else "logits.compute"
        return self.to_float32(self.node("Unsqueeze", [out, self.const("axis0", [0])], last), "logits")

    def build(self, with_hidden: bool, hidden_layers: tuple[int, ...] = ()):
        """The graph; ``with_hidden`` adds output ``hidden_states``: the LM head's input, then the residual
        stream after each of ``hidden_layers`` (transformers' ``hidden_states[j]``), side by side."""
        s = self.spec
        self.weight("embed.weight", self.take("model.embed_tokens.weight"))
        cos, sin = rotary_caches(s)
        self.weight("cos_cache", cos)
        self.weight("sin_cache", sin)
        x = self.node("Gather", ["embed.weight", "input_ids"], "embedded")
        n = self.node("SimplifiedLayerNormalization",
                      [x, self.weight("l0.in_norm.weight", self.take("model.layers.0.input_layernorm.weight"))],
                      "l0.in_norm", axis=-1, epsilon=s.eps, stash_type=1)
        residual = x
        for i in range(s.layers):
            n, residual = self.skip_norm(self.attention(i, n), residual,
                                         f"model.layers.{i}.post_attention_layernorm.weight", f"l{i}.post_norm")
            last = i + 1 == s.layers
            n, residual = self.skip_norm(self.mlp(i, n), residual, "model.norm.weight" if last else
                                         f"model.layers.{i + 1}.input_layernorm.weight",
                                         "final_norm" if last else f"l{i + 1}.in_norm",
                                         "hidden_states" if last and with_hidden and s.dtype == "float32"
                                         and not hidden_layers else None)
        logits = self.logits(n)
        if hidden_layers:  # the residual after layer j is the sum output of layer j's input norm
            parts = [self.to_float32(n, "hidden_final")] + [self.to_float32(f"l{j}.in_norm.sum", f"residual{j}")
                                                             for j in hidden_layers]
            self.node("Concat", parts, "hidden_states", axis=-1)
        elif with_hidden and s.dtype != "float32":
            self.to_float32(n, "hidden_states")
        return self.model(logits, with_hidden, len(hidden_layers))

    def model(self, logits: str, with_hidden: bool, extra_hidden: int = 0):
        from onnx import TensorProto

        h, s = self.helper, self.spec
        cache = [1, s.kv_heads, "capacity", s.head_dim]  # symbolic: a session binds buffers of kv_cache.capacity
        kv_type = TensorProto.FLOAT16 if s.dtype == "float16" else TensorProto.FLOAT
        inputs = [h.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "sequence"]),
                  h.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
                  h.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
                  h.make_tensor_value_info("num_logits", TensorProto.INT64, [1])]
        outputs = [h.make_tensor_value_info(logits, TensorProto.FLOAT, [1, "rows", s.width])]
        if s.greedy_head:
            inputs.append(h.make_tensor_value_info("greedy", TensorProto.BOOL, [1]))
            outputs += [h.make_tensor_value_info("next_ids", TensorProto.INT64, [1, "id_rows"]),
                        h.make_tensor_value_info("greedy_fallbacks", TensorProto.INT64, [])]
        for i in range(s.layers):
            pk, pv, ck, cv = (n.format(i=i) for n in PAST)
            inputs += [h.make_tensor_value_info(n, kv_type, cache) for n in (pk, pv)]
            outputs += [h.make_tensor_value_info(n, kv_type, cache) for n in (ck, cv)]
        if with_hidden:
            outputs.append(h.make_tensor_value_info("hidden_states", TensorProto.FLOAT,
                                                    [1, "sequence", s.hidden * (1 + extra_hidden)]))
        graph = h.make_graph(self.nodes, f"rlxrt_fused_{s.model_type}", inputs, outputs, self.inits)
        return h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET), h.make_opsetid(MS, 1)], ir_version=10,
                            producer_name="rlxrt")


def fused_layout(spec: Spec, with_hidden: bool, hidden_layers: tuple[int, ...] = ()) -> dict:
    """The manifest fields of a fused graph."""
    greedy = "greedy" if spec.greedy_head else None
    return {"hidden_layers": tuple(hidden_layers),
            "dtype": f"int{spec.bits}" if spec.bits else spec.dtype,
            "quantization": dict(spec.quantization) if spec.quantization else None,
            "inputs": {**INPUTS, "greedy": greedy}, "kv_cache": spec.kv_layout(), "state": None,
            "outputs": {"logits": "logits", "hidden_states": "hidden_states" if with_hidden else None,
                        "next_ids": "next_ids" if greedy else None,
                        "greedy_fallbacks": "greedy_fallbacks" if greedy else None},
            "max_positions": spec.capacity, "graph_kind": "fused"}


def build_graph(config: dict, weights: dict[str, np.ndarray], path: Path, *, capacity: int | None = None,
                with_hidden: bool = False, quantize: str | None = None, dtype: str = "float32",
                int4_compute: str = "fp32", greedy_head: bool | None = None,
                greedy_candidates: int | None = None, blocks: dict | None = None,
                vocab_ids: np.ndarray | None = None, hidden_layers: tuple[int, ...] = ()) -> Spec:
    """Write the fused graph of ``config``/``weights`` to ``path`` (weights in ``path.name + '.data'``);
    ``quantize="int4"`` stores the MatMul weights as int4 blocks (``INT4``; ``int4_compute="int8"``:
    ``INT4_INT8``), a GGUF's own ``blocks`` where given (``gguf_blocks.matched``); ``vocab_ids`` makes a
    draft-only graph whose logits cover those tokens (``draft_vocab.py``); ``hidden_layers`` adds the residual
    stream after those layers to output ``hidden_states`` (``check_hidden_layers``)."""
    import onnx

    spec = Spec(config, capacity, quantize, dtype, int4_compute, greedy_head, greedy_candidates, vocab_ids)
    check_hidden_layers(hidden_layers, spec.layers, with_hidden)
    builder = Builder(spec, weights, blocks if spec.bits else None)
    model = builder.build(with_hidden, tuple(hidden_layers))
    if builder.stored:
        spec.quantization = {**spec.quantization, "gguf": _stored_record(builder.stored)}
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=path.name + ".data", size_threshold=1024)
    return spec


def check_hidden_layers(layers, count: int, with_hidden: bool) -> None:
    """ExportError unless ``layers`` are distinct, ascending layer counts in 1..count-1 (the residual stream after
    that many layers: transformers' ``hidden_states[j]``) and the graph outputs its hidden states."""
    layers = list(layers)
    if not layers:
        return
    if not with_hidden:
        raise ExportError("--hidden-layers adds residual streams to the hidden_states output: pass "
                          "--with-hidden-states too")
    if layers != sorted(set(layers)) or not all(1 <= j < count for j in layers):
        raise ExportError(f"--hidden-layers {','.join(map(str, layers))}: give distinct layer counts in ascending "
                          f"order, each in 1..{count - 1} (this model has {count} layers), e.g. "
                          f"{','.join(map(str, default_hidden_layers(count)))}")


def default_hidden_layers(count: int) -> tuple[int, ...]:
    """A low, a middle and a high layer, as EAGLE-3 reads them (3, 15, 27 of SmolLM2's 30)."""
    picks = sorted({min(max(j, 1), count - 1) for j in (count // 10, count // 2, count - 3)})
    return tuple(j for j in picks if 1 <= j < count)


def _stored_record(stored: dict[str, str]) -> dict:
    """The manifest's account of an int4 graph from a GGUF: how many weights kept each block type or stayed
    float32, and the names of those quantised to int4 here (a second rounding; none for Q4_0/Q4_1 files)."""
    counts: dict[str, int] = {}
    for how in stored.values():
        counts[how] = counts.get(how, 0) + 1
    return {"weights": counts, "quantised_here": sorted(k for k, how in stored.items() if how == "int4")}
