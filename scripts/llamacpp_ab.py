"""rlxrt against llama.cpp on the same weights, in one interleaved run: llama.cpp's `llama-cli` (1 thread) on
a model's GGUF files against rlxrt Sessions (1 thread) on its exports, greedy, the same prompts, N new tokens
with EOS ignored; decode tokens a second (the prompt excluded on both sides), medians over prompts x repeats,
each engine's turn rotated per prompt and repeat.

    python scripts/llamacpp_ab.py --llama-cli BUILD/bin/llama-cli --gguf F32=model-f32.gguf --gguf Q4_1=model.gguf \\
        --rlxrt fp32=EXPORT --rlxrt int4=EXPORT_Q4I8 --head HEAD --out result.json

llama.cpp is built separately (cmake -B build -DGGML_NATIVE=ON && cmake --build build --target llama-cli);
its F32 file is `llama-quantize --allow-requantize model.gguf model-f32.gguf F32`, the same dequantised values
rlxrt's export reads. Each rlxrt export is measured plain and with `lookup+mtp` (prompt lookup, else HEAD)."""
import argparse
import json
import re
import statistics
import subprocess

import rlxrt
from rlxrt.sessions import Cascade, MtpHead, PromptLookup, Session

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "The capital of France is",
           "Once upon a time, in a small village by the sea,", "import os\nimport sys\n\ndef main():\n"]


def llama_rate(cli: str, gguf: str, prompt: str, n: int) -> float:
    out = subprocess.run([cli, "-m", gguf, "-p", prompt, "-n", str(n), "-t", "1", "--temp", "0", "-no-cnv",
                          "--ignore-eos"], capture_output=True, text=True, check=True).stderr
    m = re.search(r"\s eval time =\s+([\d.]+) ms /\s+(\d+) runs", out)
    return int(m.group(2)) / (float(m.group(1)) / 1000)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-cli", required=True)
    p.add_argument("--gguf", action="append", default=[], metavar="NAME=FILE")
    p.add_argument("--rlxrt", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--head", required=True, help="MTP head for the rlxrt exports")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args()
    cfg = rlxrt.Config(intra_op_threads=1)
    head = rlxrt.compile(a.head, cfg)
    sessions = {}
    for name, path in (x.split("=", 1) for x in a.rlxrt):
        graph = rlxrt.compile(path, cfg)
        sessions[f"rlxrt {name} plain"] = Session(graph, None, cfg)
        sessions[f"rlxrt {name} lookup+head k=4"] = Session(graph, Cascade(PromptLookup(min_n=3), MtpHead(head)), cfg,
                                                           k=4)
    ggufs = {f"llama.cpp {name}": path for name, path in (x.split("=", 1) for x in a.gguf)}
    rates = {name: [] for name in [*ggufs, *sessions]}
    for s in sessions.values():
        s.generate(PROMPTS[0], max_new_tokens=8, ignore_eos=True)  # warm
    for r in range(a.repeats):
        for i, prompt in enumerate(PROMPTS):
            order = list(rates)
            order = order[(r + i) % len(order):] + order[:(r + i) % len(order)]
            for name in order:
                if name in ggufs:
                    rates[name].append(llama_rate(a.llama_cli, ggufs[name], prompt, a.tokens))
                else:
                    g = sessions[name].generate(prompt, max_new_tokens=a.tokens, ignore_eos=True)
                    rates[name].append(len(g.token_ids) / g.stats.decode_seconds)
    medians = {name: statistics.median(v) for name, v in rates.items()}
    result = {"tokens": a.tokens, "repeats": a.repeats, "prompts": len(PROMPTS),
              "tok_per_s": {k: round(v, 1) for k, v in medians.items()}}
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
