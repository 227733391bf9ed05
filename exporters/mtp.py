"""An MTP draft head (DeepSeek-V3 style, chained like EAGLE) with a recurrent block, and its export.

At position p the head reads the target's last hidden state h_p and the
embedding of the next token x_{p+1}; it returns a hidden state that imitates
the target's h_{p+1} and the logits of x_{p+2} (through the target's own
output embedding). Fed its own hidden state and the token it proposed, it
chains for k proposals.

Its stateful block is a gated linear recurrence over the token stream:
s_p = a_p * s_{p-1} + (1 - a_p) * v_p with a_p, v_p computed from x_{p+1}
alone. The state therefore depends on tokens only, never on a hidden state
the head predicted itself, so after a verification the state at the last
accepted position is exact: commit selects it from the per-position states
and never re-runs the head.

Only the last fed position's outputs are ever used (the first proposal of a
round, or the next link of a chain; a prefill needs only the state), so the
graph reads the hidden state of the last position and computes the output
head there alone; the state path runs over every position.

A head with an attention layer (``HeadConfig.attention_heads``, ``head_attention.py``) also sees the earlier
positions: it reads the hidden state of EVERY fed position, appends their keys and values to its cache, and
computes the last one's output. Its cache must hold what the target computed, not what the head guessed, so
after a verification it keeps the positions read with the target's hidden states, and the next round reads
the verified ones again, with the target's rows, in one call.

Graph interface (H = hidden size, R = state size, F = H, or H * (1 + P) for a head that also reads P
residual streams of the target: ``HeadConfig.hidden_layers``)::

    inputs   input_ids [1, s] int64        x_{p+1} for each fed position p
             hidden_states [1, 1, F]       h_p of the LAST position (the target's, or the head's own)
                                           (with attention: [1, s, F], of each fed position)
             state [R]                     the state before the first position
             past_key.0, past_value.0      with attention: [1, heads, L, H / heads], the cache
    outputs  logits [1, 1, N], hidden_out [1, 1, F]   of the last position (its own H, then zeros)
             states [s, R]                 the state after each position
             present_key.0, present_value.0   with attention: the cache and the fed positions, [.., L + s, ..]

N is the vocabulary, or a reduced head's N drafted tokens: the manifest's ``draft_vocab`` then names their ids
(as a draft-only export's does), and a Session maps a drafted column to its token. A head written before that
returns logits over the whole vocabulary, -inf outside its tokens, and still runs.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rlxrt.errors import ExportError
from rlxrt.manifest import KVCacheLayout, Manifest, StateLayout, StateTensor

from .deps import versions
from .head_graph import CACHE, PAST, PRESENT, QUANTIZATION, HeadWeights, build_head_graph, int8_rows
from .head_attention import causal_attention
from .source import recorded_name
from .validate import TOLERANCE, compare

CHUNK = 32
GRAPH = "model.onnx"
INPUTS = ("input_ids", "hidden_states", "state")
OUTPUTS = ("logits", "hidden_out", "states")
VOCAB_IDS = "draft_vocab.json"
"""A reduced head's token ids (its output rows in order), also stored in its graph."""


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    vocab_size: int
    state_size: int = 256
    intermediate_size: int = 512
    rms_norm_eps: float = 1e-6
    draft_vocab: int = 0
    """Tokens the head drafts (its output layer's rows); 0: the whole vocabulary."""
    hidden_layers: tuple[int, ...] = ()
    """The target's layers whose residual stream it reads beside the last hidden state (the target's
    ``hidden_layers``, ``rlxrt export --hidden-layers``): its ``hidden_states`` input is then
    ``hidden_size * (1 + len)`` wide."""
    attention_heads: int = 0
    """Heads of its causal self-attention layer over the earlier positions (``head_attention.py``; 0: none, the head
    sees the past through its token recurrence and the last hidden state alone)."""

    @property
    def input_size(self) -> int:
        """The width of the hidden states it reads (and returns, its own followed by zeros)."""
        return self.hidden_size * (1 + len(self.hidden_layers))


def build_head(torch, cfg: HeadConfig, embedding, unembedding=None, vocab_ids=None, train_embedding=False):
    """The head as a torch module. ``embedding`` [V, H] is the target's input embedding and
    ``unembedding`` [V, H] its LM head weight (None when tied); both are copied and frozen.

    With ``vocab_ids`` [N] (a reduced draft vocabulary) the head works in N tokens: ``embedding`` is then
    [N + 1, H] (row N for every token outside the subset) and ``unembedding`` [N, H] (the target's output rows
    of those tokens); it returns the logits of those N tokens, and the acceptance rule sees a draft
    distribution that is zero outside them.
    ``train_embedding`` lets the input embedding learn (when it is an estimate, not the target's own)."""
    nn = torch.nn
    H, R, I = cfg.hidden_size, cfg.state_size, cfg.intermediate_size
    V, P = cfg.vocab_size, len(cfg.hidden_layers)

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(H))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * self.weight

    class MtpHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Parameter(embedding.detach().clone().float(), requires_grad=train_embedding)
            self.unembed = None if unembedding is None else \
                nn.Parameter(unembedding.detach().clone().float(), requires_grad=False)
            self.vocab_size = V
            self.reduced = vocab_ids is not None
            if self.reduced:
                ids = torch.as_tensor(vocab_ids, dtype=torch.long)
                slot = torch.full((V,), len(ids), dtype=torch.long)
                slot[ids] = torch.arange(len(ids))
                self.register_buffer("vocab_ids", ids)
                self.register_buffer("slot", slot)
            self.norm_h, self.norm_e, self.norm_m, self.norm_f = RMSNorm(), RMSNorm(), RMSNorm(), RMSNorm()
            self.norm_x = nn.ModuleList(RMSNorm() for _ in cfg.hidden_layers)
            """One norm for each residual stream it reads (EAGLE-3's low, middle and high features)."""
            self.fuse = nn.Linear((2 + P) * H, H, bias=False)
            self.gate_in = nn.Linear(H, 2 * R)
            self.state_out = nn.Linear(R, H, bias=False)
            self.up = nn.Linear(H, 2 * I, bias=False)
            self.down = nn.Linear(I, H, bias=False)
            self.attn = causal_attention(torch, H, cfg.attention_heads, cfg.rms_norm_eps) \
                if cfg.attention_heads else None

        def gates(self, ids):
            """Per position: log a_p and (1 - a_p) * v_p, from the token alone."""
            e = self.norm_e(nn.functional.embedding(self.slot[ids] if self.reduced else ids, self.embed))
            pre, v = self.gate_in(e).chunk(2, dim=-1)
            return e, -nn.functional.softplus(-pre), torch.sigmoid(-pre) * v

        def fused(self, h, e, states):
            """The layer's input at each position: the target's hidden states ``h`` (H, or H * (1 + P) with the
            residual streams), or the head's own H (the streams are then zeros, as in the graph, whose
            ``hidden_out`` is its own state followed by zeros), the token's embedding and the state."""
            parts = [self.norm_h(h[..., :H])]
            if P:
                parts += [torch.zeros_like(parts[0])] * P if h.shape[-1] == H else \
                    [n(h[..., (i + 1) * H:(i + 2) * H]) for i, n in enumerate(self.norm_x)]
            return self.fuse(torch.cat([*parts, e], dim=-1)) + self.state_out(states)

        def block(self, z):
            """Everything after the attention: the predicted hidden state and the logits over the head's own
            vocabulary (N tokens when reduced)."""
            g, u = self.up(self.norm_m(z)).chunk(2, dim=-1)
            z = z + self.down(nn.functional.silu(g) * u)
            hid = self.norm_f(z)
            return hid @ self.out_weight().t(), hid

        def sequential(self, h, e, states):
            """Logits and hidden state at every position of a window read in order (the graph's computation)."""
            z = self.fused(h, e, states)
            return self.block(z if self.attn is None else self.attn(z)[0])

        def two_steps(self, h, e, states):
            """Training form over windows [B, T, ...]: the first step at each position p (the target's h_p and
            x_{p+1}) and the chained one at p + 1 (the head's own hidden state and x_{p+2}), which attends to
            the positions up to p as the graph would (the target's, kept) and to itself."""
            z = self.fused(h, e, states)
            z, k, v = (z, None, None) if self.attn is None else self.attn(z)
            logits1, hid1 = self.block(z)
            z2 = self.fused(hid1[:, :-1], e[:, 1:], states[:, 1:])
            return logits1, hid1, self.block(z2 if self.attn is None else self.attn.chained(z2, k, v))[0]

        def out_weight(self):
            return self.embed if self.unembed is None else self.unembed

        def scan_loop(self, log_a, b, s0):
            """Training form: [B, T, R] sequentially (any length)."""
            a, out, s = log_a.exp(), [], s0
            for t in range(b.shape[1]):
                s = a[:, t] * s + b[:, t]
                out.append(s)
            return torch.stack(out, dim=1)

        def padded(self, hid):
            """The head's own hidden state as wide as its input: followed by zeros for the streams it reads."""
            return hid if not P else torch.cat([hid, hid.new_zeros(*hid.shape[:-1], P * H)], dim=-1)

    return MtpHead()


def head_manifest(cfg: HeadConfig, target: Manifest, validation: dict, quantize: str | None = None) -> Manifest:
    """The head's manifest: the target's vocabulary and limits, one state tensor, the target it drafts for."""
    return Manifest(
        architecture="RlxrtMtpHead", model_type="mtp-head", vocab_size=cfg.vocab_size,
        max_positions=target.max_positions, graph=GRAPH, dtype=quantize or "float32",
        quantization=dict(QUANTIZATION[quantize]) if quantize else None,
        inputs={"input_ids": "input_ids", "hidden_states": "hidden_states", "attention_mask": None,
                "position_ids": None},
        outputs={"logits": "logits", "hidden_states": "hidden_out"}, kv_cache=_cache(cfg),
        state=StateLayout((StateTensor("state", "states", (cfg.state_size,), "float32"),), CHUNK),
        bos_token_id=target.bos_token_id, eos_token_ids=target.eos_token_ids, pad_token_id=target.pad_token_id,
        tokenizer=None, versions=versions(),
        source={"task": "mtp-head", "config": asdict(cfg), "weights_stored_as": quantize or "float16"},
        validation=validation,
        draft_vocab={"size": cfg.draft_vocab, "ids": VOCAB_IDS} if cfg.draft_vocab else None,
        draft_head={"kind": "mtp", "hidden_size": cfg.input_size, "target": _target_record(target),
                    **({"hidden_layers": list(cfg.hidden_layers)} if cfg.hidden_layers else {}),
                    **({"attention_heads": cfg.attention_heads} if cfg.attention_heads else {}),
                    **({"draft_vocab": cfg.draft_vocab, "draft_vocab_ids": VOCAB_IDS} if cfg.draft_vocab else {})})


def _cache(cfg: HeadConfig) -> KVCacheLayout | None:
    """The attention layer's cache: keys and values of every position fed (none without the layer)."""
    if not cfg.attention_heads:
        return None
    return KVCacheLayout(layers=1, kv_heads=cfg.attention_heads, head_dim=cfg.hidden_size // cfg.attention_heads,
                         dtype="float32", past_key=CACHE[0], past_value=CACHE[1], present_key=CACHE[2],
                         present_value=CACHE[3])


def _target_record(target: Manifest) -> dict:
    """The target the head drafts for: its source's name (no absolute path) and weights hash."""
    path_or_id = target.source.get("path_or_id")
    return {"path_or_id": None if path_or_id is None else recorded_name(path_or_id),
            "weights_sha256": target.source.get("weights_sha256")}


def validate_head(torch, head, run, tolerance: float = TOLERANCE["float32"], prompt_len: int = 8,
                  step_len: int = 4) -> dict:
    """ORT vs the torch head run sequentially (its training form): a prefill from zero state,
    then a step from the prefill's last state (and cache); the last position's logits and hidden output, and
    the states of all positions."""
    F, R = head.fuse.in_features - head.embed.shape[1], head.state_out.in_features  # F: the input's width
    rng = np.random.default_rng(0)
    ids = rng.integers(0, head.vocab_size, size=(1, prompt_len + step_len), dtype=np.int64)
    hidden = rng.standard_normal((1, prompt_len + step_len, F)).astype(np.float32)
    with torch.no_grad():
        e, log_a, b = head.gates(torch.from_numpy(ids))
        states = head.scan_loop(log_a, b, torch.zeros(1, R))
        ref, ref_hid = head.sequential(torch.from_numpy(hidden), e, states)
        ref_hid = head.padded(ref_hid)
    end = prompt_len + step_len
    each = head.attn is not None  # the hidden state of every fed position, or of the last one alone
    first = {"input_ids": ids[:, :prompt_len], "hidden_states": hidden[:, :prompt_len] if each else
             hidden[:, prompt_len - 1:prompt_len], "state": np.zeros(R, np.float32)}
    if each:
        first |= {n: np.zeros((1, head.attn.heads, 0, head.embed.shape[1] // head.attn.heads), np.float32)
                  for n in PAST}
    a = run(first)
    c = run({"input_ids": ids[:, prompt_len:], "hidden_states": hidden[:, prompt_len:] if each else hidden[:, end - 1:],
             "state": a["states"][-1], **({p: a[q] for p, q in zip(PAST, PRESENT)} if each else {})})
    last = [prompt_len - 1, end - 1]
    diffs = {"max_abs_diff_hidden": float(np.abs(np.concatenate([a["hidden_out"], c["hidden_out"]], 1)
                                                 - ref_hid.numpy()[:, last]).max()),
             "max_abs_diff_state": float(np.abs(np.concatenate([a["states"], c["states"]]) - states[0].numpy()).max())}
    return compare(a["logits"], c["logits"], ref.numpy()[:, last], tolerance, **diffs)


def write_head(torch, head, cfg: HeadConfig, target: Manifest, out: Path, run_for,
               quantize: str | None = None) -> Manifest:
    """Write ``head``'s graph (``head_graph``) into the model directory ``out``, validated against the torch
    head; ``run_for(graph_path)`` gives a ``run(feeds) -> {name: array}`` (the application's ``runner``).
    float32: the weights are rounded to float16 and stored so (half the file), computed in float32, and
    must match the torch head to float32 tolerance. ``quantize="int4"``: the projections and the output
    layer as int4 blocks (``HEAD_INT4``), checked to int4 tolerance; ``"int8"``: as 8-bit blocks, and the input
    embedding as int8 rows, which the torch head takes too (so only the blocks differ), checked to int8
    tolerance."""
    if quantize not in (None, *QUANTIZATION):
        raise ExportError(f"an MTP head quantises to {' or '.join(QUANTIZATION)} only, not {quantize!r}")
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():  # weights on the float16 grid: stored as float16, computed in float32, validated as is
        for p in head.parameters():
            p.copy_(p.half().float())
        if quantize == "int8":  # the embedding's rows on their int8 grid, as stored
            codes, scales = int8_rows(head.embed.detach().numpy())
            head.embed.copy_(torch.from_numpy(codes.astype(np.float32) * scales))
    build_head_graph(HeadWeights.from_state_dict(head.state_dict(), cfg.rms_norm_eps, cfg.attention_heads),
                     out / GRAPH, quantize)
    record = validate_head(torch, head, run_for(out / GRAPH), TOLERANCE[quantize or "float32"])
    if not record["passed"]:
        raise ExportError(f"MTP head validation failed: ORT and torch differ ({record}); nothing usable was written")
    manifest = head_manifest(cfg, target, record, quantize)
    if head.reduced:
        (out / VOCAB_IDS).write_text(json.dumps(head.vocab_ids.tolist()), encoding="utf-8")
    manifest.write(out)
    return manifest
