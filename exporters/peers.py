"""Hugging Face transformers (torch) on the same weights: plain and assisted generation, for ``rlxrt bench``."""
from __future__ import annotations

import time
from pathlib import Path

from .deps import require_export_stack


class HFPeers:
    names = ["hf plain", "hf assisted"]

    def __init__(self, target_dir: Path, draft_dir: Path, threads: int = 1):
        torch, transformers, _ = require_export_stack()
        torch.set_num_threads(threads)
        self.torch, self.transformers = torch, transformers
        load = transformers.AutoModelForCausalLM.from_pretrained
        self.target = load(str(target_dir), dtype=torch.float32).eval()
        self.draft = load(str(draft_dir), dtype=torch.float32).eval()
        self.tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(Path(target_dir) / "tokenizer.json"))
        self.eos = self.target.config.eos_token_id

    def run(self, name: str, prompt: str, max_new_tokens: int, temperature: float, seed: int) -> tuple[float, int]:
        torch = self.torch
        ids = torch.tensor([self.tokenizer.encode(prompt)])
        sampling = dict(do_sample=True, temperature=temperature, top_k=0) if temperature > 0 else dict(do_sample=False)
        # no EOS: every configuration generates exactly max_new_tokens, as rlxrt's runs do (ignore_eos)
        config = self.transformers.GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=None,
                                                    pad_token_id=self.eos, **sampling)
        kwargs = dict(generation_config=config, attention_mask=torch.ones_like(ids))
        if name == "hf assisted":
            kwargs["assistant_model"] = self.draft
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.target.generate(ids, **kwargs)
        return time.perf_counter() - t0, int(out.shape[1] - ids.shape[1])
