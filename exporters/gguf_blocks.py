"""A GGUF's own blocks, kept by ``--quantize int4``: no second quantisation of Q4_0, Q4_1 and Q8_0 weights.

llama.cpp's Q4_0, Q4_1 and Q8_0 store blocks of 32 weights along a row's input dimension, as MatMulNBits does:

    Q4_0  value = d * (code - 8)          MatMulNBits with scale d: exactly
    Q4_1  value = d * code + m            = d * (code - 8) + (m + 8 d): MatMulNBits with scale d, plus the
                                            block sums of the input times (m + 8 d), a [blocks, N] MatMul
    Q8_0  value = d * q                   8-bit MatMulNBits (code q + 128) when the graph computes with int8
                                            activations (accuracy level 4); at level 0 ONNX Runtime has no
                                            fast 8-bit kernel (30x slower, measured), so such a weight stays
                                            float32 there: its values, not a coarser int4 copy

Quantising the dequantised weights again would add a second rounding on top of the GGUF's (on
SmolLM2-135M-Instruct's Q4_1 file, argmax agreement with the float32 graph fell to 0.42 on the validation's
random tokens). Each block is matched to the Hugging Face tensor the GGUF was dequantised into, under the row
order llama.cpp's converter gives q/k (or none): a tensor whose blocks do not reproduce it is quantised as
any other, so a mismatch can cost accuracy but never a wrong weight.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 32
KINDS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
"""The block types kept, and their bytes a block."""
NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}
"""llama.cpp's names of a layer's projections, and the Hugging Face ones."""
MATCH = 1e-6
"""Largest difference, relative to the tensor's largest weight, for blocks to count as that tensor."""


@dataclass
class Blocks:
    """A [N, K] weight as blocks along K: ``scale * (codes - zero) + shift`` (shift None: Q4_0, Q8_0); ``zero``
    is 8 for 4-bit codes, 128 for 8-bit ones (MatMulNBits' default zero points)."""

    codes: np.ndarray
    """[N, K / 32, 32] uint8: 0..15 (4 bits) or 0..255 (8 bits)."""
    scale: np.ndarray
    """[N, K / 32] float32."""
    shift: np.ndarray | None
    """[N, K / 32] float32, or None."""
    kind: str

    @property
    def bits(self) -> int:
        return 8 if self.kind == "Q8_0" else 4

    def values(self) -> np.ndarray:
        w = self.scale[..., None] * (self.codes.astype(np.float32) - (1 << (self.bits - 1)))
        if self.shift is not None:
            w = w + self.shift[..., None]
        return w.reshape(len(self.codes), -1)

    def rows(self, order: np.ndarray) -> "Blocks":
        return Blocks(self.codes[order], self.scale[order], None if self.shift is None else self.shift[order],
                      self.kind)

    @staticmethod
    def stack(parts: list["Blocks"]) -> "Blocks | None":
        """Several weights' rows one after the other (packed projections); a Q4_0 part gets a zero shift when
        another part has one. None when 4-bit and 8-bit parts meet."""
        if len({p.bits for p in parts}) > 1:
            return None
        shifts = [p.shift if p.shift is not None else np.zeros_like(p.scale) for p in parts]
        any_shift = any(p.shift is not None for p in parts)
        return Blocks(np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts]),
                      np.concatenate(shifts) if any_shift else None, "+".join(sorted({p.kind for p in parts})))


def parse(kind: str, raw: np.ndarray) -> Blocks:
    """Blocks from a tensor's raw bytes [N, blocks * bytes a block]."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, KINDS[kind])
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":  # int8 values; as codes with zero point 128
        return Blocks((b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, None, kind)
    qs = b[..., 4:] if kind == "Q4_1" else b[..., 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # element j and j + 16 share byte j
    if kind == "Q4_0":
        return Blocks(codes, d, None, kind)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return Blocks(codes, d, m + 8 * d, kind)


def read(path: Path) -> dict[str, Blocks]:
    """The Q4_0, Q4_1 and Q8_0 matrices of a GGUF file by their GGUF names."""
    from gguf import GGUFReader

    out = {}
    for t in GGUFReader(str(path)).tensors:
        kind = t.tensor_type.name
        if kind in KINDS and len(t.data.shape) == 2:
            out[t.name] = parse(kind, np.asarray(t.data))
    return out


def hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{NAMES[parts[2]]}.weight"
    return None


def unpermute(rows: int, heads: int) -> np.ndarray | None:
    """The row order that undoes llama.cpp's q/k permutation for ``heads`` heads (None if it cannot apply)."""
    if heads <= 0 or rows % (2 * heads):
        return None
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


def matched(path: Path, weights: dict[str, np.ndarray], config: dict) -> dict[str, Blocks]:
    """The GGUF's blocks of each Hugging Face weight they reproduce (``MATCH``), under their stored row
    order or the one that undoes llama.cpp's q/k permutation; other tensors are left out."""
    heads = int(config.get("num_attention_heads", 0))
    kv = int(config.get("num_key_value_heads", heads) or heads)
    out = {}
    for name, blocks in read(path).items():
        target = hf_name(name)
        w = weights.get(target) if target else None
        if w is None or w.shape != (blocks.codes.shape[0], blocks.codes.shape[1] * BLOCK):
            continue
        tol = MATCH * max(float(np.abs(w).max()), 1e-30)
        for order in (None, unpermute(len(w), heads), unpermute(len(w), kv)):
            candidate = blocks if order is None else blocks.rows(order)
            if float(np.abs(candidate.values() - w).max()) <= tol:
                out[target] = candidate
                break
    return out
