"""A tiny hybrid language model (an attention layer with a KV cache, then a recurrent layer with
per-position states), exported with torch.onnx and given an rlxrt manifest: the session's hybrid path
on a real ORT graph. No Hugging Face hybrid family is exported by rlxrt yet."""
from __future__ import annotations

from pathlib import Path

from rlxrt.manifest import KVCacheLayout, Manifest, StateLayout, StateTensor

VOCAB = 320


def make_hybrid(out: Path, *, seed: int = 0, hidden: int = 32, state: int = 24, chunk: int = 8) -> Path:
    import torch

    nn = torch.nn
    torch.manual_seed(seed)

    class Hybrid(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, hidden)
            self.pos = nn.Embedding(256, hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.o = nn.Linear(hidden, hidden)
            self.gate = nn.Linear(hidden, 2 * state)
            self.back = nn.Linear(state, hidden)
            self.lm = nn.Linear(hidden, VOCAB)
            for p in self.parameters():
                nn.init.normal_(p, std=0.2)

        def forward(self, input_ids, attention_mask, position_ids, past_key, past_value, state0):
            x = self.emb(input_ids[0]) + self.pos(position_ids[0])              # [s, H]
            s, past = x.shape[0], past_key.shape[2]
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            keys = torch.cat([past_key[0, 0], k], dim=0)                        # [P + s, H]
            values = torch.cat([past_value[0, 0], v], dim=0)
            j = torch.arange(keys.shape[0])[None, :]
            i = past + torch.arange(s)[:, None]
            scores = (q @ keys.t()) / hidden ** 0.5 + torch.zeros(s, keys.shape[0]).masked_fill(j > i, -torch.inf)
            scores = scores + (attention_mask[0, None, :].float() - 1.0) * 1e4     # padding (none here)
            x = x + self.o(torch.softmax(scores, -1) @ values)
            pre, val = self.gate(x).chunk(2, dim=-1)
            S = torch.cumsum(-nn.functional.softplus(-pre), dim=0)              # [s, R]
            pos = torch.arange(s)
            mask = torch.zeros(s, s).masked_fill(pos[None, :] > pos[:, None], -torch.inf)[:, :, None]
            w = torch.exp(S[:, None, :] - S[None, :, :] + mask)
            states = (w * (torch.sigmoid(-pre) * val)[None]).sum(1) + torch.exp(S) * state0[None]
            logits = self.lm(x + self.back(states))
            return logits[None], keys[None, None], values[None, None], states

    model = Hybrid().eval()
    out.mkdir(parents=True, exist_ok=True)
    args = (torch.zeros((1, 3), dtype=torch.long), torch.ones((1, 5), dtype=torch.long),
            torch.arange(2, 5)[None], torch.zeros((1, 1, 2, hidden)), torch.zeros((1, 1, 2, hidden)),
            torch.zeros(state))
    names = ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key", "past_key_values.0.value",
             "state"]
    outs = ["logits", "present.0.key", "present.0.value", "states"]
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(out / "model.onnx"), input_names=names, output_names=outs,
                          opset_version=17, dynamo=False,
                          dynamic_axes={"input_ids": {1: "s"}, "attention_mask": {1: "total"},
                                        "position_ids": {1: "s"}, "past_key_values.0.key": {2: "past"},
                                        "past_key_values.0.value": {2: "past"}, "logits": {1: "s"},
                                        "present.0.key": {2: "total"}, "present.0.value": {2: "total"},
                                        "states": {0: "s"}})
    Manifest(architecture="TinyHybrid", model_type="tiny-hybrid", vocab_size=VOCAB, max_positions=256,
             graph="model.onnx", dtype="float32",
             inputs={"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids"},
             outputs={"logits": "logits", "hidden_states": None},
             kv_cache=KVCacheLayout(1, 1, hidden, "float32", "past_key_values.{i}.key", "past_key_values.{i}.value",
                                    "present.{i}.key", "present.{i}.value"),
             state=StateLayout((StateTensor("state", "states", (state,), "float32"),), chunk),
             eos_token_ids=(1,), validation={"skipped": True}).write(out)
    return out
