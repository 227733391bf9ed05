#!/usr/bin/env bash
# A maintainer's check of rlxrt on a CUDA machine, self-contained and offline: it exports the shipped pair and a
# 1.1B-parameter random-weight Llama shape in float16 (without torch), checks that speculative greedy equals
# plain greedy for every speculator at k = 1, 4, 8, runs `rlxrt bench` (against onnxruntime-genai-cuda on the
# same weights when its directories are given), checks that the KV cache stays on the device during a long
# request, and writes one JSON summary. The project's tests and CI stay CPU-only; this is how a GPU release is
# verified. Needs: a CUDA GPU, onnxruntime-gpu, rlxrt installed from this checkout (`pip install --no-deps -e .`
# beside numpy, onnx, tokenizers, jinja2), nvidia-smi; optionally onnxruntime-genai-cuda.
#
#   scripts/gpu_check.sh [OUT]                       OUT defaults to gpu-check-out/
#   OGA_TARGET=DIR OGA_DRAFT=DIR scripts/gpu_check.sh   add onnxruntime-genai-cuda rows for the shipped pair
#   (its directories built with `python -m onnxruntime_genai.models.builder -i exporters/reference/weights/target
#    -o DIR -p fp16 -e cuda`, where a newer transformers is installed; scripts/build_oga.sh does the CPU ones)
#   GPU_CHECK_PROVIDERS=cpu GPU_CHECK_BIG=tiny scripts/gpu_check.sh   a dry run of the plumbing on a CPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu-check-out}"
mkdir -p "$OUT"
python - "$OUT" <<'PY'
import json, os, platform, shutil, struct, subprocess, sys, threading, time
from pathlib import Path

import numpy as np

OUT = Path(sys.argv[1]).resolve()
PROVIDERS = os.environ.get("GPU_CHECK_PROVIDERS", "cuda")
BIG = os.environ.get("GPU_CHECK_BIG", "1.1b")
SHAPES = {"1.1b": dict(layers=22, hidden=2048, heads=32, kv=4, mlp=5632, vocab=4096),
          "tiny": dict(layers=2, hidden=256, heads=8, kv=4, mlp=688, vocab=4096)}
"""The 1.1B Llama shape (TinyLlama's layers) with the shipped pair's 4,096-token tokenizer, so that text prompts
and the bench run on it too (its output layer is then 2048 x 4096 instead of 2048 x 32000)."""
summary = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "providers": PROVIDERS, "big_shape": BIG,
           "python": platform.python_version(), "notes": []}


def run(*cmd, **kw):
    print("$", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def versions():
    import onnxruntime as ort

    out = {"onnxruntime": ort.__version__, "available_providers": ort.get_available_providers()}
    try:
        import onnxruntime_genai as og

        out["onnxruntime_genai"] = og.__version__
    except ImportError:
        out["onnxruntime_genai"] = None
    try:
        out["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
    except OSError:
        out["gpu"] = None
    return out


def random_llama(path: Path, shape: dict, seed: int) -> Path:
    """A Hugging Face Llama directory of random float16 weights (config.json + model.safetensors), no torch."""
    if (path / "model.safetensors").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    h, d = shape["hidden"], shape["hidden"] // shape["heads"]
    tensors = {"model.embed_tokens.weight": (shape["vocab"], h), "model.norm.weight": (h,)}
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                        p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (shape["kv"] * d, h),
                        p + "self_attn.v_proj.weight": (shape["kv"] * d, h), p + "self_attn.o_proj.weight": (h, h),
                        p + "mlp.gate_proj.weight": (shape["mlp"], h), p + "mlp.up_proj.weight": (shape["mlp"], h),
                        p + "mlp.down_proj.weight": (h, shape["mlp"])})
    header, offset = {}, 0
    for name, dims in tensors.items():
        size = int(np.prod(dims)) * 2
        header[name] = {"dtype": "F16", "shape": list(dims), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for name, dims in tensors.items():
            w = np.ones(dims, np.float16) if name.endswith("norm.weight") else \
                (rng.standard_normal(dims, np.float32) * 0.02).astype(np.float16)
            fh.write(w.tobytes())
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": shape["mlp"], "num_hidden_layers": shape["layers"],
              "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv"], "head_dim": d,
              "vocab_size": shape["vocab"], "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 0,
              "eos_token_id": 0}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path("exporters/reference/weights/target") / name, path / name)
    return path


def export(src: Path, out: Path, *flags) -> Path:
    if not (out / "rlxrt.json").is_file():
        run(sys.executable, "-m", "rlxrt", "export", src, out, "--force", "--quiet", *flags)
    return out


def exactness(target: Path, draft: Path | None, prompts, tokens: int, rows=None) -> dict:
    """Speculative greedy against plain greedy, per speculator and k: how many prompts differ; ``rows`` is
    Config.fixed_rows (None: auto, 9 rows on a GPU; 0: every call as many rows as it needs)."""
    import rlxrt
    from rlxrt.sessions import DraftModel, PromptLookup, Session

    cfg = rlxrt.Config(providers=tuple(PROVIDERS.split(",")), strict=True, cache=False, fixed_rows=rows)
    graph = rlxrt.compile(target, cfg)
    plain = [Session(graph, None, cfg).generate(p, max_new_tokens=tokens, ignore_eos=True).token_ids for p in prompts]
    kinds = {"prompt-lookup": PromptLookup}
    if draft is not None:
        draft_graph = rlxrt.compile(draft, cfg)
        kinds["draft"] = lambda: DraftModel(draft_graph)
    rows = {}
    for name, make in kinds.items():
        for k in (1, 4, 8):
            s = Session(graph, make(), cfg, k=k)
            got = [s.generate(p, max_new_tokens=tokens, ignore_eos=True) for p in prompts]
            first = [next((i for i, (a, b) in enumerate(zip(g.token_ids, want)) if a != b), None)
                     for g, want in zip(got, plain)]
            rows[f"{name} k={k}"] = {"prompts_differing": sum(f is not None for f in first),
                                     "first_difference_at": first, "prompts": len(prompts),
                                     "acceptance": round(s.stats.acceptance_rate, 3)}
    return {"graph_providers": graph.providers, "rows_class": graph.rows, "fixed_rows": Session(graph, None, cfg).rows,
            "speculators": rows, "exact": all(r["prompts_differing"] == 0 for r in rows.values())}


def pcie_during(target: Path, prompt, tokens: int) -> dict:
    """PCIe traffic (nvidia-smi dmon) during one long plain request: a KV cache copied between host and device
    every step would move ~layers x 2 x kv x d x length x 2 bytes a step; a resident one moves ids and logits."""
    import rlxrt
    from rlxrt.sessions import Session

    if shutil.which("nvidia-smi") is None:
        return {"skipped": "no nvidia-smi"}
    cfg = rlxrt.Config(providers=tuple(PROVIDERS.split(",")), strict=True, cache=False)
    session = Session(target, None, cfg)
    dmon = subprocess.Popen(["nvidia-smi", "dmon", "-s", "t", "-d", "1"], stdout=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    g = session.generate(prompt, max_new_tokens=tokens, ignore_eos=True)
    seconds = time.monotonic() - t0
    dmon.terminate()
    samples = []
    for line in dmon.stdout.read().splitlines():
        parts = line.split()
        if parts and parts[0].isdigit() and len(parts) >= 3:
            samples.append((float(parts[1]), float(parts[2])))  # rxpci, txpci in MB/s
    return {"tokens": len(g.token_ids), "seconds": round(seconds, 2), "tok_per_s": round(len(g.token_ids) / seconds, 1),
            "pcie_rx_tx_MBps_max": [max((s[0] for s in samples), default=None), max((s[1] for s in samples), default=None)],
            "samples": len(samples)}


def bench(target: Path, draft: Path, out: Path, oga_target=None, oga_draft=None) -> dict:
    cmd = [sys.executable, "-m", "rlxrt", "bench", "--target", target, "--draft", draft, "--providers", PROVIDERS,
           "--no-hf", "--no-head", "--ks", "1,4,8", "--temperatures", "0", "--prompts", "8", "--repeats", "3",
           "--out", out, "--quiet"]  # fixed rows auto: 9 rows a call on a GPU, plain decoding included
    if oga_target:
        cmd += ["--oga-target", oga_target] + (["--oga-draft", oga_draft] if oga_draft else [])
    run(*cmd)
    data = json.loads((out / "bench.json").read_text())
    keep = ("tokens_per_s", "speedup", "acceptance_rate", "tokens_per_round", "python_overhead_share")
    return {"rows": {row: {k: v for k, v in cfg.items() if k in keep} for row, cfg in data["temperatures"]["0.0"].items()},
            "step_times_s": data.get("step_times_s")}


summary["versions"] = versions()
weights = Path("exporters/reference/weights")
pair = {name: export(weights / name, OUT / f"pair-{name}-fp16", "--dtype", "fp16") for name in ("target", "draft")}
big_src = random_llama(OUT / f"big-{BIG}-hf", SHAPES[BIG], seed=0)
small = dict(SHAPES[BIG], layers=1)
big_draft_src = random_llama(OUT / f"big-{BIG}-draft-hf", small, seed=1)
big = export(big_src, OUT / f"big-{BIG}-fp16", "--dtype", "fp16", "--max-context", "2048")
big_draft = export(big_draft_src, OUT / f"big-{BIG}-draft-fp16", "--dtype", "fp16", "--max-context", "2048")
summary["notes"].append("bf16: rlxrt's fused exporter writes float32 and float16 only; bf16 is not checked")
summary["notes"].append("MTP head: the shipped head was trained for the float32 target's weights hash and does not "
                        "bind to these float16 exports of the fp16 checkpoint; not checked")

from rlxrt.app.reference import reference_prompts  # noqa: E402

text_prompts = reference_prompts()[:8]
summary["exactness"] = {}
for rows, label in ((None, "fixed rows auto"), (0, "fixed rows off")):  # off: what exactness was before fixed rows
    summary["exactness"][f"shipped pair fp16, {label}"] = exactness(pair["target"], pair["draft"], text_prompts, 128, rows)
    summary["exactness"][f"{BIG} random fp16, {label}"] = exactness(big, big_draft, text_prompts[:3], 128, rows)
summary["pcie"] = pcie_during(big, text_prompts[0], 1900 if BIG == "1.1b" else 200)
summary["bench"] = {"shipped pair fp16": bench(pair["target"], pair["draft"], OUT / "bench-pair",
                                               os.environ.get("OGA_TARGET"), os.environ.get("OGA_DRAFT")),
                    f"{BIG} random fp16": bench(big, big_draft, OUT / "bench-big", os.environ.get("OGA_BIG"))}
summary["exact_with_fixed_rows"] = all(v["exact"] for k, v in summary["exactness"].items() if "auto" in k)
summary["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
(OUT / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
print(json.dumps({k: summary[k] for k in ("exact_with_fixed_rows", "pcie")}, default=str))
print(f"wrote {OUT / 'summary.json'}")
PY
