"""onnxruntime-genai on the same weights, for ``rlxrt bench``: plain, draft speculation and n-gram lookup.

Its model directories are built with its own model builder (``scripts/build_oga.sh``: that needs
transformers >= 5, so it runs in a separate virtual environment); running them needs only the
``onnxruntime-genai`` package, which brings the same onnxruntime rlxrt then runs on. The three
configurations are composite ``genai_config.json`` files written into a temporary directory that point
at the model files: the target's decoder, the draft's as ``model.draft`` with ``speculative``
``max_draft_tokens``, and ``speculative.ngram_size`` for n-gram lookup. Greedy only (temperature 0).
"""
from __future__ import annotations

import copy
import json
import os
import tempfile
import time
from pathlib import Path

from rlxrt.errors import UsageError
from rlxrt.files import read_json


def _decoder(model_dir: Path, config_dir: Path, role: str, threads: int) -> dict:
    """The decoder block of ``model_dir``, its files linked under ``config_dir/role`` (onnxruntime-genai
    refuses paths that leave the config's directory)."""
    block = copy.deepcopy(read_json(model_dir / "genai_config.json", "onnxruntime-genai config")["model"]["decoder"])
    (config_dir / role).mkdir()
    for f in model_dir.iterdir():
        if f.name.startswith(block["filename"]):
            os.symlink(f.resolve(), config_dir / role / f.name)
    block["filename"] = f"{role}/{block['filename']}"
    opts = block.setdefault("session_options", {})
    opts["intra_op_num_threads"] = threads
    opts["inter_op_num_threads"] = 1
    return block


class OgaPeers:
    """``names`` and ``run(name, prompt, max_new_tokens, temperature, seed) -> (seconds, tokens)``."""

    def __init__(self, target_dir: Path, draft_dir: Path | None, threads: int = 1, k: int = 4, encode=None):
        """``encode(text) -> ids``: rlxrt's tokenizer, so both engines get the same prompt ids (the peer's own
        tokenizer may read a tokenizer.json differently)."""
        try:
            import onnxruntime_genai as og
        except ImportError:
            raise UsageError("--oga-target needs the onnxruntime-genai package: pip install onnxruntime-genai "
                             "(it brings onnxruntime, which must then be the only ORT build installed)") from None
        for d in (target_dir, draft_dir):
            if d is not None and not (Path(d) / "genai_config.json").is_file():
                raise UsageError(f"{str(d)!r} has no genai_config.json; build it with scripts/build_oga.sh")
        self.og, self.k = og, k
        self._tmp = tempfile.TemporaryDirectory(prefix="rlxrt-oga-")
        root = Path(self._tmp.name)
        base = read_json(Path(target_dir) / "genai_config.json", "onnxruntime-genai config")
        variants = {"oga plain": None, f"oga n-gram k={k}": {"ngram_size": 3, "max_draft_tokens": k}}
        if draft_dir is not None:
            variants[f"oga draft k={k}"] = {"max_draft_tokens": k}
        self.models, self.names = {}, list(variants)
        for name, speculative in variants.items():
            d = root / name.replace(" ", "-").replace("=", "")
            d.mkdir()
            cfg = copy.deepcopy(base)
            cfg["model"]["decoder"] = _decoder(Path(target_dir), d, "target", threads)
            if name.startswith("oga draft"):
                cfg["model"]["draft"] = _decoder(Path(draft_dir), d, "draft", threads)
            if speculative:
                cfg["speculative"] = speculative
            (d / "genai_config.json").write_text(json.dumps(cfg, indent=1))
            for f in ("tokenizer.json", "tokenizer_config.json"):
                if (Path(target_dir) / f).is_file():
                    (d / f).write_bytes((Path(target_dir) / f).read_bytes())
            self.models[name] = og.Model(str(d))
        self.encode = encode or og.Tokenizer(self.models["oga plain"]).encode

    def run(self, name: str, prompt: str, max_new_tokens: int, temperature: float, seed: int) -> tuple[float, int]:
        seconds, ids = self.generate(name, prompt, max_new_tokens)
        return seconds, len(ids)

    def generate(self, name: str, prompt: str, max_new_tokens: int) -> tuple[float, list[int]]:
        """(seconds, generated ids) of one greedy request of exactly ``max_new_tokens`` (EOS ignored, as in
        rlxrt's bench)."""
        og, model = self.og, self.models[name]
        ids = list(self.encode(prompt))
        params = og.GeneratorParams(model)
        total = len(ids) + max_new_tokens
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        t0 = time.perf_counter()
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        while not gen.is_done():
            gen.generate_next_token()
        seconds = time.perf_counter() - t0
        return seconds, [int(t) for t in gen.get_sequence(0)[len(ids):]]
