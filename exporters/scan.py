"""A linear recurrence in closed form, for graphs that return the state after every fed position.

s_t = a_t * s_{t-1} + b_t (elementwise, 0 < a_t <= 1) unrolls to

    s_t = exp(S_t) * s_0 + sum_{u <= t} exp(S_t - S_u) * b_u,    S_t = sum_{r <= t} log a_r,

where S decreases in t, so every exponent is <= 0 (no overflow). It is loop-free (one graph for any
length) and costs O(T^2) per call, so graphs that use it take a bounded number of tokens per call.
Mamba's selective scan (mamba.py) and the MTP head's gated state (mtp.py) are both this recurrence.
"""
from __future__ import annotations


def closed_form_scan(torch, log_a, b, s0):
    """The states after each position of s_t = a_t * s_{t-1} + b_t.

    log_a  [T, C]  log a_t (all <= 0), one column per independent channel
    b      [T, C]  the input added at each position
    s0     [C]     the state before the first position
    returns [T, C] the state after each position
    """
    T = log_a.shape[0]
    S = torch.cumsum(log_a, dim=0)                                         # [T, C], decreasing in t
    pos = torch.arange(T)
    mask = torch.zeros(T, T).masked_fill(pos[None, :] > pos[:, None], -torch.inf)[:, :, None]  # [t, u, 1]
    w = torch.exp(S[:, None, :] - S[None, :, :] + mask)                    # [t, u, C], exponents <= 0
    return (w * b[None, :, :]).sum(1) + torch.exp(S) * s0[None, :]
