"""Mamba (``MambaForCausalLM``, and ``FalconMambaForCausalLM``) to ONNX with per-position states.

optimum exports no recurrent architecture, so rlxrt writes the graph itself:
the model's own weights run in a re-statement of Mamba's forward that takes
the state before the first fed token and returns the state after EACH fed
token. Verification of k+1 tokens is then one graph call, and a commit picks
the state at the last accepted position without re-running anything.

The selective scan h_t = exp(A dt_t) h_{t-1} + dt_t B_t x_t is written in
closed form (``scan.closed_form_scan`` with log a_t = A dt_t). It costs O(s^2)
per call, so a graph call takes at most ``CHUNK`` tokens and sessions feed
longer prompts in chunks.

Graph interface (L layers, D = intermediate size, K = conv kernel, N = state size)::

    inputs   input_ids [1, s] int64
             conv_state [L, 1, D, K], ssm_state [L, 1, D, N]      state before the first token
    outputs  logits [1, s, V]
             conv_states [s, L, 1, D, K], ssm_states [s, L, 1, D, N]   state after each token
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from rlxrt.manifest import StateLayout, StateTensor

from .scan import closed_form_scan
from .validate import compare, hidden_diff

CHUNK = 32
INPUTS = ("input_ids", "conv_state", "ssm_state")
OUTPUTS = ("logits", "conv_states", "ssm_states")


MAX_POSITIONS = 1 << 20
"""Mamba has no position limit; this bounds a request all the same."""


def max_positions(config) -> int:
    return MAX_POSITIONS


def inputs(config) -> dict:
    return {"input_ids": "input_ids", "attention_mask": None, "position_ids": None}


def kv_layout(config) -> None:
    return None


def state_layout(config) -> StateLayout:
    L, D = config.num_hidden_layers, config.intermediate_size
    return StateLayout(
        tensors=(StateTensor("conv_state", "conv_states", (L, 1, D, config.conv_kernel), "float32"),
                 StateTensor("ssm_state", "ssm_states", (L, 1, D, config.state_size), "float32")),
        max_tokens_per_call=CHUNK)


def selective_mixer(torch, mix, h, conv0, ssm0):
    """One Mamba mixer over h [1, s, H] from the states before the first token; returns its output and the
    conv windows [s, 1, D, K] and SSM states [s, 1, D, N] after each token. FalconMamba's and Jamba's
    mixers (RMS norms on dt, B and C) run through here too."""
    nn = torch.nn
    s = h.shape[1]
    proj = mix.in_proj(h).transpose(1, 2)                       # [1, 2D, s]
    x, gate = proj.chunk(2, dim=1)
    k = mix.conv_kernel_size
    full = torch.cat([conv0, x], dim=-1)                         # [1, D, K + s]
    idx = torch.arange(s)[:, None] + 1 + torch.arange(k)[None, :]
    windows = full[:, :, idx]                                    # [1, D, s, K]
    conv = (windows * mix.conv1d.weight[:, 0, :][None, :, None, :]).sum(-1)
    if mix.use_conv_bias:
        conv = conv + mix.conv1d.bias[None, :, None]
    x = mix.act(conv)                                            # [1, D, s]
    xt = x[0].t()                                                # [s, D], time-major from here
    params = mix.x_proj(xt)
    dt, B, C = torch.split(params, [mix.time_step_rank, mix.ssm_state_size, mix.ssm_state_size], dim=-1)
    if hasattr(mix, "dt_layernorm"):  # Jamba: RMS norms with weights
        dt, B, C = mix.dt_layernorm(dt), mix.b_layernorm(B), mix.c_layernorm(C)
    elif hasattr(mix, "rms_eps"):  # FalconMamba: RMS norms without weights
        dt, B, C = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + mix.rms_eps) for t in (dt, B, C))
    dt = nn.functional.softplus(mix.dt_proj(dt))                 # [s, D]
    A = -torch.exp(mix.A_log.float())                            # [D, N]
    d, n = A.shape
    log_a = (dt[:, :, None] * A[None]).reshape(s, d * n)          # [s, D*N], all <= 0
    dbu = ((dt * xt)[:, :, None] * B[:, None, :]).reshape(s, d * n)   # [s, D*N]
    hs = closed_form_scan(torch, log_a, dbu, ssm0.reshape(d * n)).reshape(s, d, n)  # [s, D, N]
    y = (hs * C[:, None, :]).sum(-1) + xt * mix.D[None, :]        # [s, D]
    y = y * mix.act(gate[0].t())
    out = mix.out_proj(y)[None]
    return out, windows.permute(2, 0, 1, 3), hs[:, None]


def _wrapper(torch, model, with_hidden: bool):
    nn = torch.nn

    class MambaWithStates(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, conv_state, ssm_state):
            bb = self.m.backbone
            h = bb.embeddings(input_ids)
            convs, ssms = [], []
            for i, layer in enumerate(bb.layers):
                out, c, st = selective_mixer(torch, layer.mixer, layer.norm(h), conv_state[i], ssm_state[i])
                h = h + out
                convs.append(c)
                ssms.append(st)
            h = bb.norm_f(h)
            out = (self.m.lm_head(h), torch.stack(convs, 1), torch.stack(ssms, 1))
            return out + (h,) if with_hidden else out

    return MambaWithStates().eval()


def export_graph(torch, model, path: Path, with_hidden: bool = False) -> None:
    wrapper = _wrapper(torch, model, with_hidden)
    cfg = model.config
    L, D = cfg.num_hidden_layers, cfg.intermediate_size
    ids = torch.zeros((1, 3), dtype=torch.long)
    conv = torch.zeros((L, 1, D, cfg.conv_kernel))
    ssm = torch.zeros((L, 1, D, cfg.state_size))
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter is deprecated but exports this loop-free graph
        torch.onnx.export(wrapper, (ids, conv, ssm), str(path), input_names=list(INPUTS),
                          output_names=list(OUTPUTS) + (["hidden_states"] if with_hidden else []),
                          opset_version=17, dynamo=False,
                          dynamic_axes={"input_ids": {1: "sequence_length"}, "logits": {1: "sequence_length"},
                                        "conv_states": {0: "sequence_length"},
                                        "ssm_states": {0: "sequence_length"},
                                        "hidden_states": {1: "sequence_length"}})


def validate_graph(torch, model, run, tolerance: float, prompt_len: int = 8, step_len: int = 4) -> dict:
    """ORT vs PyTorch: a prefill from zero state, then a step from the prefill's last state; the
    state after the step against Mamba's own cache."""
    cfg = model.config
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(1, prompt_len + step_len), dtype=np.int64)
    with torch.no_grad():
        ref_out = model(input_ids=torch.from_numpy(ids), use_cache=True)
    ref = ref_out.logits.float().numpy()
    layout = state_layout(cfg)
    zeros = [np.zeros(t.shape, np.float32) for t in layout.tensors]
    a = run({"input_ids": ids[:, :prompt_len], "conv_state": zeros[0], "ssm_state": zeros[1]})
    b = run({"input_ids": ids[:, prompt_len:], "conv_state": a["conv_states"][-1], "ssm_state": a["ssm_states"][-1]})
    cache = ref_out.cache_params
    ref_conv = torch.stack(list(cache.conv_states)).numpy()[:, :1]
    ref_ssm = torch.stack(list(cache.ssm_states)).numpy()[:, :1]
    state_diff = max(float(np.abs(b["conv_states"][-1] - ref_conv).max()),
                     float(np.abs(b["ssm_states"][-1] - ref_ssm).max()))
    return compare(a["logits"], b["logits"], ref, tolerance, max_abs_diff_state=state_diff,
                   **hidden_diff(torch, model, ids, a, b))
