"""A tiny GGUF written in the test session with the gguf package, as llama.cpp's converter writes a Llama:
the weights of a random-init Hugging Face llama (q/k rows permuted for llama.cpp's rotary layout) and its
byte-level BPE tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, path: Path, *, add_bos: bool, chat_template: str | None = None,
               quant: dict[str, str] | None = None) -> Path:
    """``quant`` stores tensors in llama.cpp's block types by their short name, e.g. {"attn_q": "Q4_0",
    "output": "Q8_0"}; the rest are F32."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    w = load_file(str(hf_dir / "model.safetensors"))
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(H)
    writer.add_block_count(L)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(H // heads)
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    vocab = {t: i for t, i in tok["model"]["vocab"].items()}
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv_: kv_[1])]
    special = {a["content"] for a in tok["added_tokens"] if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_add_bos_token(add_bos)
    if chat_template:
        writer.add_chat_template(chat_template)
    f32 = lambda name: np.ascontiguousarray(w[name], dtype=np.float32)  # noqa: E731

    def add(name: str, data: np.ndarray) -> None:
        kind = (quant or {}).get(name.split(".")[-2])
        if kind is None:
            writer.add_tensor(name, data)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", f32("model.embed_tokens.weight"))
    add("output_norm.weight", f32("model.norm.weight"))
    add("output.weight", f32("lm_head.weight"))
    for i in range(L):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", f32(p + "input_layernorm.weight"))
        add(f"blk.{i}.attn_q.weight", _permute(f32(p + "self_attn.q_proj.weight"), heads))
        add(f"blk.{i}.attn_k.weight", _permute(f32(p + "self_attn.k_proj.weight"), kv))
        add(f"blk.{i}.attn_v.weight", f32(p + "self_attn.v_proj.weight"))
        add(f"blk.{i}.attn_output.weight", f32(p + "self_attn.o_proj.weight"))
        add(f"blk.{i}.ffn_norm.weight", f32(p + "post_attention_layernorm.weight"))
        add(f"blk.{i}.ffn_gate.weight", f32(p + "mlp.gate_proj.weight"))
        add(f"blk.{i}.ffn_up.weight", f32(p + "mlp.up_proj.weight"))
        add(f"blk.{i}.ffn_down.weight", f32(p + "mlp.down_proj.weight"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
