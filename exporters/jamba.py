"""Jamba (``JambaForCausalLM``) to ONNX: a hybrid of Mamba layers and attention layers in one graph.

The Mamba layers carry recurrent state and return it after EACH fed token
(``mamba.selective_mixer``, with Jamba's RMS norms on dt, B and C); the
attention layers carry a KV cache (past in, present out; Jamba has no
position embedding). A session uses both mechanisms in one commit: the cache
rolls back by length, the state by selection. Mixture-of-experts layers run in
dense form: every expert computes, the router's top-k weights (zero elsewhere)
combine them, which is exactly the sparse result.

Graph interface (A attention layers, M Mamba layers; D, K, N as in mamba.py)::

    inputs   input_ids [1, s], attention_mask [1, past + s]
             past_key_values.{i}.key / .value [1, kv_heads, past, head_dim]   i < A
             conv_state [M, 1, D, K], ssm_state [M, 1, D, N]
    outputs  logits [1, s, V], present.{i}.key / .value [1, kv_heads, past + s, head_dim]
             conv_states [s, M, 1, D, K], ssm_states [s, M, 1, D, N]
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from rlxrt.manifest import KVCacheLayout, StateLayout, StateTensor

from .mamba import selective_mixer
from .validate import compare, hidden_diff

CHUNK = 32
PAST = ("past_key_values.{i}.key", "past_key_values.{i}.value", "present.{i}.key", "present.{i}.value")


def _counts(config) -> tuple[int, int]:
    types = list(config.layers_block_type)
    return types.count("attention"), types.count("mamba")


def state_layout(config) -> StateLayout:
    _, M = _counts(config)
    D = config.mamba_expand * config.hidden_size
    return StateLayout(
        tensors=(StateTensor("conv_state", "conv_states", (M, 1, D, config.mamba_d_conv), "float32"),
                 StateTensor("ssm_state", "ssm_states", (M, 1, D, config.mamba_d_state), "float32")),
        max_tokens_per_call=CHUNK)


def kv_layout(config) -> KVCacheLayout:
    A, _ = _counts(config)
    return KVCacheLayout(A, config.num_key_value_heads, config.hidden_size // config.num_attention_heads,
                         "float32", *PAST)


def max_positions(config) -> int:
    return int(config.max_position_embeddings)


def inputs(config) -> dict:
    return {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": None}


def _attention(torch, attn, h, past_k, past_v, mask):
    s = h.shape[1]
    nh, nkv, hd = attn.num_heads, attn.num_key_value_heads, attn.head_dim
    q = attn.q_proj(h).view(1, s, nh, hd).transpose(1, 2)
    k = attn.k_proj(h).view(1, s, nkv, hd).transpose(1, 2)
    v = attn.v_proj(h).view(1, s, nkv, hd).transpose(1, 2)
    keys, values = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)     # [1, nkv, T, hd]
    total = keys.shape[2]
    rep = nh // nkv
    kr = keys[:, :, None].expand(1, nkv, rep, total, hd).reshape(1, nh, total, hd)
    vr = values[:, :, None].expand(1, nkv, rep, total, hd).reshape(1, nh, total, hd)
    j = torch.arange(total)[None, :]
    i = (total - s) + torch.arange(s)[:, None]
    blocked = (j > i) | (mask[0][None, :] == 0)
    scores = q @ kr.transpose(2, 3) / math.sqrt(hd) + torch.zeros(s, total).masked_fill(blocked, -torch.inf)
    out = (torch.softmax(scores, dim=-1) @ vr).transpose(1, 2).reshape(1, s, nh * hd)
    return attn.o_proj(out), keys, values


def _feed_forward(torch, ff, x):
    if not hasattr(ff, "router"):
        return ff(x)
    weights = torch.softmax(ff.router(x), dim=-1)                                   # [1, s, E]
    top, idx = torch.topk(weights, ff.top_k, dim=-1)
    gate = torch.zeros_like(weights).scatter(-1, idx, top)                          # top-k weights, 0 elsewhere
    outs = torch.stack([expert(x) for expert in ff.experts], dim=-1)                 # [1, s, H, E]
    return (outs * gate[:, :, None, :]).sum(-1)


def _wrapper(torch, model, with_hidden: bool):
    nn = torch.nn

    class JambaWithStates(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, conv_state, ssm_state, *past):
            core = self.m.model
            h = core.embed_tokens(input_ids)
            presents, convs, ssms = [], [], []
            a = m = 0
            for layer in core.layers:
                x = layer.input_layernorm(h)
                if hasattr(layer, "mamba"):
                    out, c, st = selective_mixer(torch, layer.mamba, x, conv_state[m], ssm_state[m])
                    convs.append(c)
                    ssms.append(st)
                    m += 1
                else:
                    out, k, v = _attention(torch, layer.self_attn, x, past[2 * a], past[2 * a + 1], attention_mask)
                    presents += [k, v]
                    a += 1
                h = h + out
                h = h + _feed_forward(torch, layer.feed_forward, layer.pre_ff_layernorm(h))
            h = core.final_layernorm(h)
            out = (self.m.lm_head(h), torch.stack(convs, 1), torch.stack(ssms, 1), *presents)
            return out + (h,) if with_hidden else out

    return JambaWithStates().eval()


def _names(config) -> tuple[list[str], list[str]]:
    A, _ = _counts(config)
    past = [p.format(i=i) for i in range(A) for p in PAST[:2]]
    present = [p.format(i=i) for i in range(A) for p in PAST[2:]]
    return past, present


def export_graph(torch, model, path: Path, with_hidden: bool = False) -> None:
    import warnings

    cfg = model.config
    layout, kv = state_layout(cfg), kv_layout(cfg)
    past_names, present_names = _names(cfg)
    args = (torch.zeros((1, 3), dtype=torch.long), torch.ones((1, 5), dtype=torch.long),
            *(torch.zeros(t.shape) for t in layout.tensors),
            *(torch.zeros((1, kv.kv_heads, 2, kv.head_dim)) for _ in past_names))
    dynamic = {"input_ids": {1: "s"}, "attention_mask": {1: "total"}, "logits": {1: "s"},
               "conv_states": {0: "s"}, "ssm_states": {0: "s"}, "hidden_states": {1: "s"}}
    dynamic.update({n: {2: "past"} for n in past_names})
    dynamic.update({n: {2: "total"} for n in present_names})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter is deprecated but exports this loop-free graph
        torch.onnx.export(_wrapper(torch, model, with_hidden), args, str(path),
                          input_names=["input_ids", "attention_mask", "conv_state", "ssm_state", *past_names],
                          output_names=["logits", "conv_states", "ssm_states", *present_names]
                          + (["hidden_states"] if with_hidden else []),
                          opset_version=17, dynamo=False, dynamic_axes=dynamic)


def validate_graph(torch, model, run, tolerance: float, prompt_len: int = 8, step_len: int = 4) -> dict:
    """ORT vs PyTorch: a prefill from empty cache and zero state, then a step with the prefill's cache and
    last state; the final Mamba states against transformers' own cache."""
    cfg = model.config
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(1, prompt_len + step_len), dtype=np.int64)
    from transformers.models.jamba.modeling_jamba import HybridMambaAttentionDynamicCache

    cache = HybridMambaAttentionDynamicCache(cfg, batch_size=1, dtype=torch.float32)
    with torch.no_grad():
        ref_out = model(input_ids=torch.from_numpy(ids), past_key_values=cache, use_cache=True)
    ref = ref_out.logits.float().numpy()
    layout, kv = state_layout(cfg), kv_layout(cfg)
    past_names, present_names = _names(cfg)
    empty = np.zeros((1, kv.kv_heads, 0, kv.head_dim), np.float32)
    feeds = {"input_ids": ids[:, :prompt_len], "attention_mask": np.ones((1, prompt_len), np.int64),
             "conv_state": np.zeros(layout.tensors[0].shape, np.float32),
             "ssm_state": np.zeros(layout.tensors[1].shape, np.float32), **{n: empty for n in past_names}}
    a = run(feeds)
    feeds = {"input_ids": ids[:, prompt_len:], "attention_mask": np.ones((1, prompt_len + step_len), np.int64),
             "conv_state": a["conv_states"][-1], "ssm_state": a["ssm_states"][-1],
             **{p: a[q] for p, q in zip(past_names, present_names)}}
    b = run(feeds)
    mamba_layers = [i for i, t in enumerate(cfg.layers_block_type) if t == "mamba"]
    ref_conv = np.stack([cache.conv_states[i].numpy()[:1] for i in mamba_layers])
    ref_ssm = np.stack([cache.ssm_states[i].numpy()[:1] for i in mamba_layers])
    state_diff = max(float(np.abs(b["conv_states"][-1] - ref_conv).max()),
                     float(np.abs(b["ssm_states"][-1] - ref_ssm).max()))
    return compare(a["logits"], b["logits"], ref, tolerance, max_abs_diff_state=state_diff,
                   **hidden_diff(torch, model, ids, a, b))
