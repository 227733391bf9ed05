"""The MTP head's causal self-attention layer (EAGLE's): each position attends to the head's inputs at the
positions before it, so a proposal sees more of the context than the last hidden state carries.

It has no position encoding: the order reaches it through causality and the head's token recurrence, and the
head is trained on windows of ``teacher.WINDOW`` tokens. Keys and values come from the layer's input at each
position, which for every position the target has verified is built from the target's own hidden state; a
chained proposal's query attends to those and to its own key (the graph's cache holds exactly that).
"""
from __future__ import annotations

import math


def causal_attention(torch, hidden: int, heads: int, eps: float):
    """The layer as a torch module: ``layer(z)`` -> (z + attention over z causally, keys, values) for z [B, T, H];
    ``layer.chained(z2, k, v)``: z2 [B, T - 1, H] at positions 1..T-1 attending to the keys of 0..p and itself."""
    nn = torch.nn
    if hidden % heads:
        raise ValueError(f"--attention-heads {heads} does not divide the head's hidden size {hidden}")
    d = hidden // heads

    class CausalAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = heads
            self.norm = nn.Parameter(torch.ones(hidden))
            self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
            self.o = nn.Linear(hidden, hidden, bias=False)
            nn.init.zeros_(self.o.weight)  # starts as the identity: the head without it

        def project(self, z):
            x = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * self.norm
            return [t.view(*t.shape[:-1], heads, d).transpose(-2, -3) for t in self.qkv(x).chunk(3, -1)]

        def merge(self, y):
            return self.o(y.transpose(-2, -3).reshape(*y.shape[:-3], y.shape[-2], hidden))

        def forward(self, z):
            q, k, v = self.project(z)
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return z + self.merge(y), k, v

        def chained(self, z2, k, v):
            q2, k2, v2 = self.project(z2)
            t = z2.shape[-2]
            scores = q2 @ k[..., :t, :].transpose(-1, -2) / math.sqrt(d)            # keys of positions <= p
            scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
            own = (q2 * k2).sum(-1, keepdim=True) / math.sqrt(d)
            p = torch.softmax(torch.cat([scores, own], -1), -1)
            return z2 + self.merge(p[..., :t] @ v[..., :t, :] + p[..., t:] * v2)

    return CausalAttention()
