"""Sampling transforms and per-request random numbers (numpy only).

The same transform is applied to the draft's and the target's logits before
the acceptance rule, so the rule compares the distributions that would really
be sampled. Temperature 0 means greedy: the distribution is one-hot at the
argmax.

Example::

    >>> p = probs([[2.0, 1.0, 0.0]], SamplingParams(temperature=1.0, top_k=2))
    >>> p.round(3).tolist()
    [[0.731, 0.269, 0.0]]
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checks import as_float, as_int
from .errors import GenerationError

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    """0 is greedy; > 0 divides the logits before the softmax."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 keeps all."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "temperature", as_float(self.temperature, "temperature (0 = greedy)", 0.0))
        set_(self, "top_k", as_int(self.top_k, "top_k (0 = off)", 0))
        p = as_float(self.top_p, "top_p (1 = off)", 0.0, 1.0)
        if p == 0.0:
            raise GenerationError("top_p must be in (0, 1] (1 = off), got 0.0; use temperature=0 for greedy")
        set_(self, "top_p", p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_rng(seed: int | None) -> np.random.Generator:
    """A counter-based (Philox) generator: the same seed reproduces a run exactly."""
    if seed is not None:
        seed = as_int(seed, "seed (or None)", 0)
    return np.random.Generator(np.random.Philox(seed))


def probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Rows of logits [n, V] -> rows of probabilities [n, V] (float64) after the transforms."""
    x = np.asarray(logits)
    if x.ndim == 1:
        x = x[None]
    if params.greedy:
        out = np.zeros(x.shape, np.float64)
        out[np.arange(x.shape[0]), x.argmax(-1)] = 1.0
        return out
    # exp in float32 (4x faster than float64 in numpy; relative error ~1e-7), sums in float64.
    # The max is subtracted BEFORE scaling, so every scaled value is <= 0 and exp cannot overflow; the
    # scale 1/T is kept within float32's normal range, so T = 1e-300 gives a one-hot row and T = 1e300 a
    # uniform one (a masked -inf stays -inf: it is never multiplied by 0), never NaN.
    x = x.astype(np.float32)  # a fresh array: work in place below
    v = x.shape[-1]
    if 0 < params.top_k < v:  # order is the same before and after scaling
        kth = np.partition(x, v - params.top_k, axis=-1)[:, v - params.top_k][:, None]
        x[x < kth] = -np.inf
    x -= x.max(-1, keepdims=True)
    with np.errstate(over="ignore"):  # a huge scale sends non-max entries to -inf: exp gives 0, as meant
        x *= np.float32(min(max(1.0 / params.temperature, FLOAT32_TINY), FLOAT32_MAX))
    p = np.exp(x, out=x).astype(np.float64)
    total = p.sum(-1, keepdims=True)
    if not np.isfinite(total).all():  # NaN logits: the model is broken, never a silent wrong token
        raise GenerationError(f"the model produced non-finite logits (NaN) in {int((~np.isfinite(total)).sum())} "
                              "row(s); check the export (e.g. fp16 overflow) or use the fp32 variant")
    p /= total
    if params.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, -1)
        before = np.cumsum(sorted_p, -1) - sorted_p  # mass strictly before each token
        keep_sorted = before < params.top_p          # the first token is always kept
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, -1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a probability row [V] by inverting its CDF."""
    c = p.cumsum()
    i = int(c.searchsorted(rng.random() * c[-1], side="right"))
    return i if i < p.shape[0] else p.shape[0] - 1
