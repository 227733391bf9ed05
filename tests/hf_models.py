"""Tiny random-init Hugging Face models and a tokenizer, built inside the test session (no hub)."""
from __future__ import annotations

from pathlib import Path

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
    "Hello, world! Speculative decoding is exact. Ünïcödé → 数学 ✓\n",
]


def make_tokenizer(out: Path, vocab_size: int = 320, chat_template: str | None = None):
    """A byte-level BPE tokenizer saved as a fast Hugging Face tokenizer (with ``chat_template`` if given; the
    chat tokens <|im_start|> and <|im_end|> are special tokens); returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    chat_tokens = ["<|im_start|>", "<|im_end|>"] if chat_template else []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"] + chat_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template is not None:
        fast.chat_template = chat_template
        fast.eos_token = "<|im_end|>"  # as instruct models ship it: the end-of-turn token is the tokenizer's EOS
    fast.save_pretrained(str(out))
    return tok.get_vocab_size()


def make_model(family: str, out: Path, *, seed: int = 0, layers: int = 2, hidden: int = 64,
               tokenizer: bool = True, init: float = 0.2, chat_template: str | None = None,
               intermediate: int | None = None):
    """Save a random-init causal LM of ``family`` (llama, qwen2, qwen3, mistral, gpt2, mamba, falcon_mamba, jamba)
    in ``out``; ``intermediate`` is the MLP's width for the llama-like families (default 2 * hidden)."""
    import torch
    import transformers as tf

    out.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(out, chat_template=chat_template) if tokenizer else 320
    common = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=2, initializer_range=init)
    if family == "falcon_mamba":
        cfg = tf.FalconMambaConfig(hidden_size=hidden, num_hidden_layers=layers, state_size=8, expand=2,
                                   conv_kernel=4, time_step_rank=8, use_cache=True, **common)
        cls = tf.FalconMambaForCausalLM
    elif family == "mamba":
        cfg = tf.MambaConfig(hidden_size=hidden, num_hidden_layers=layers, state_size=8, expand=2, conv_kernel=4,
                             time_step_rank=8, use_cache=True, **common)
        cls = tf.MambaForCausalLM
    elif family == "jamba":  # hybrid: layers 1 and 3 attention, 0 and 2 Mamba; MoE (2 experts, top 1) on odd layers
        cfg = tf.JambaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                             expert_layer_period=2, expert_layer_offset=1, num_experts=2, num_experts_per_tok=1,
                             mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
                             use_mamba_kernels=False, max_position_embeddings=256, tie_word_embeddings=False, **common)
        cls = tf.JambaForCausalLM
    elif family == "gpt2":
        cfg = tf.GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=256, **common)
        cls = tf.GPT2LMHeadModel
    else:
        cfg_cls, cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
                        "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[family]
        cfg = cfg_cls(hidden_size=hidden, intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, **({"head_dim": hidden // 4} if family == "qwen3" else {}), **common)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.save_pretrained(str(out))
    return model
