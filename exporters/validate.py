"""Validate an exported graph against PyTorch: a prefill and a (k+1)-token step with a past.

The graph is run through a ``run(feeds) -> {name: array}`` callable that the
caller builds (``rlxrt.export`` uses ``rlxrt.backends.compile``), so this
module creates no ORT session itself.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from rlxrt.manifest import Manifest

# Max abs logit difference allowed, relative to max(1, max |reference logit|).
TOLERANCE = {"float32": 1e-3, "float16": 3e-2, "int8": 0.3, "int4": 0.5}
VALIDATION_POSITIONS = 16
"""Room a fused graph's validation buffers keep beyond the prefill, for the step that follows it."""


def reference_logits(torch, model, vocab_size: int, prompt_len: int = 8, step_len: int = 4, seed: int = 0):
    """Token ids for a prefill and a following step, and PyTorch's logits for both."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, size=(1, prompt_len + step_len), dtype=np.int64)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(ids), use_cache=False).logits.float().numpy()
    return ids, logits


def feeds_for(manifest: Manifest, ids: np.ndarray, past: list[np.ndarray] | None, past_len: int,
              greedy: bool = False) -> dict:
    kv = manifest.kv_cache
    s = ids.shape[1]
    feeds = {manifest.inputs["input_ids"]: ids}
    if manifest.inputs.get("attention_mask"):
        feeds[manifest.inputs["attention_mask"]] = np.ones((1, past_len + s), np.int64)
    if manifest.inputs.get("position_ids"):
        feeds[manifest.inputs["position_ids"]] = np.arange(past_len, past_len + s, dtype=np.int64)[None]
    if manifest.graph_kind == "fused":  # positions and rows as numbers; the past is the whole buffer
        feeds[manifest.inputs["seqlens_k"]] = np.array([past_len + s - 1], np.int32)
        feeds[manifest.inputs["total_sequence_length"]] = np.array(past_len + s, np.int32)
        feeds[manifest.inputs["num_logits"]] = np.array([s], np.int64)
        if manifest.inputs.get("greedy"):
            feeds[manifest.inputs["greedy"]] = np.array([greedy])
    if kv is not None:
        for i in range(kv.layers):
            pk, pv, _, _ = kv.names(i)
            if past is None:  # a fused graph's buffer: only as long as the check needs (its length is symbolic)
                length = min(kv.capacity, past_len + s + VALIDATION_POSITIONS) if kv.capacity else 0
                empty = np.zeros((1, kv.kv_heads, length, kv.head_dim), dtype=kv.dtype)
                feeds[pk], feeds[pv] = empty, empty
            else:
                feeds[pk], feeds[pv] = past[2 * i], past[2 * i + 1]
    return feeds


def validate(run: Callable[[dict], dict], manifest: Manifest, ids: np.ndarray, ref: np.ndarray,
             prompt_len: int, tolerance: float, extra: Callable[..., dict] | None = None) -> dict:
    """Compare the graph with PyTorch's reference logits; ``extra(prefill_outputs, step_outputs)`` adds
    more differences that must pass (e.g. ``hidden_diff``). Returns the record stored in the manifest."""
    kv = manifest.kv_cache
    logits_name = manifest.outputs["logits"]
    first = out = run(feeds_for(manifest, ids[:, :prompt_len], None, 0))
    prefill = out[logits_name].astype(np.float32)
    past = []
    if kv is not None:
        for i in range(kv.layers):
            _, _, ck, cv = kv.names(i)
            past += [out[ck], out[cv]]
    out = run(feeds_for(manifest, ids[:, prompt_len:], past, prompt_len))
    step = out[logits_name].astype(np.float32)
    record = compare(prefill, step, ref, tolerance, **(extra(first, out) if extra else {}))
    if manifest.inputs.get("greedy"):  # the greedy head must pick the argmax of the graph's own logits
        got = [run(feeds_for(manifest, ids[:, :prompt_len], None, 0, True)),
               run(feeds_for(manifest, ids[:, prompt_len:], past, prompt_len, True))]
        name = manifest.outputs["next_ids"]
        wrong = sum(ids_wrong(g[name][0], lg[0].argmax(-1), fed[0, 1:])
                    for g, lg, fed in ((got[0], prefill, ids[:, :prompt_len]), (got[1], step, ids[:, prompt_len:])))
        record.update(greedy_ids_wrong=wrong, passed=record["passed"] and wrong == 0)
    return record


def ids_wrong(ids: np.ndarray, argmax: np.ndarray, fed: np.ndarray) -> int:
    """How many of a greedy head's ``ids`` [rows] break its contract against the ``argmax`` of the logits:
    exact up to the first row whose argmax differs from the token ``fed`` after it ([rows - 1]), exact or
    -2 (not read) after it."""
    differs = np.flatnonzero(argmax[:-1] != fed)
    read = int(differs[0]) + 1 if differs.size else len(ids)
    return int((ids[:read] != argmax[:read]).sum() + ((ids[read:] != argmax[read:]) & (ids[read:] != -2)).sum())


def compare(prefill: np.ndarray, step: np.ndarray, ref: np.ndarray, tolerance: float, **extra_diffs: float) -> dict:
    """The validation record: graph logits of a prefill [1, p, V] and a step [1, s, V] against PyTorch's
    [1, p + s, V]; ``extra_diffs`` (e.g. a state's max abs diff) must pass the same tolerance."""
    prompt_len = prefill.shape[1]
    got = np.concatenate([prefill, step], axis=1)
    diff = float(np.abs(got - ref).max())
    scale = max(1.0, float(np.abs(ref).max()))
    return {
        "passed": max([diff, *extra_diffs.values()]) <= tolerance * scale,
        "max_abs_diff": diff,
        "max_abs_diff_prefill": float(np.abs(prefill - ref[:, :prompt_len]).max()),
        "max_abs_diff_step": float(np.abs(step - ref[:, prompt_len:]).max()),
        **extra_diffs,
        "tolerance": tolerance * scale,
        "argmax_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean()),
        "positions": int(ref.shape[1]),
        "step_tokens": int(step.shape[1]),
    }


def hidden_diff(torch, model, ids: np.ndarray, *outs: dict, layers: tuple[int, ...] = ()) -> dict:
    """``{"max_abs_diff_hidden": …}`` of the graph's ``hidden_states`` outputs (one dict per call, in order)
    against transformers' last hidden state for ``ids``; empty when the graph has no such output. With
    ``layers`` (``rlxrt export --hidden-layers``) the output goes on with transformers' ``hidden_states[j]`` of
    each, compared as ``max_rel_diff_residuals``: the residual streams grow through the layers, so each one's
    difference is taken relative to its largest value (at least 1)."""
    if "hidden_states" not in outs[0]:
        return {}
    with torch.no_grad():
        o = model.base_model(input_ids=torch.from_numpy(ids), output_hidden_states=bool(layers))
    got = np.concatenate([o_["hidden_states"] for o_ in outs], axis=1).astype(np.float32)
    ref = o.last_hidden_state.float().numpy()
    width = ref.shape[-1]
    if got.shape[-1] != width * (1 + len(layers)):  # not the width the manifest says: fails
        return {"max_abs_diff_hidden": float("inf")}
    record = {"max_abs_diff_hidden": float(np.abs(got[..., :width] - ref).max())}
    if layers:
        rel = []
        for i, j in enumerate(layers, start=1):
            part = o.hidden_states[j].float().numpy()
            rel.append(float(np.abs(got[..., i * width:(i + 1) * width] - part).max()) / max(1.0, float(np.abs(part).max())))
        record["max_rel_diff_residuals"] = max(rel)
    return record
