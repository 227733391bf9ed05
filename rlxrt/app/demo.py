"""``rlxrt demo``: stream a code completion of a held-out prompt with speculative decoding, then show
the speed against plain decoding measured in the same run, and the acceptance statistics."""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import TextIO


def run_demo(target: Path, draft: Path | None, prompt: str, *, max_new_tokens: int = 128, k: int | None = None,
             config=None, repeats: int = 3, out: TextIO | None = None, head: Path | None = None,
             chat: bool = False, lookup: bool = False) -> dict:
    """``config`` (an ``rlxrt.Config``; default: 1 intra-op thread on the CPU) is used for both models; the
    speculator is the ``draft`` model, or the MTP ``head``, behind prompt lookup when ``lookup``; ``chat``
    sends the prompt as a user message."""
    from rlxrt.backends import compile
    from rlxrt.config import Config
    from rlxrt.sessions import Session

    from .speculators import build

    out = out if out is not None else sys.stdout  # looked up per call: a default would pin the import-time one
    config = config if config is not None else Config(intra_op_threads=1, providers=("cpu",))
    threads = config.intra_op_threads or "ORT's default"
    t0 = time.perf_counter()
    target_graph = compile(target, config)
    kind = ("lookup+" if lookup else "") + ("mtp" if head else "draft")
    spec = Session(target_graph, build(kind, head or draft, config), k=k)
    plain = Session(target_graph)
    load_s = time.perf_counter() - t0
    k = spec.k
    model = spec.speculator.sources[-1] if lookup else spec.speculator
    tm, dm = spec.manifest, model.model.manifest
    helper = (f"MTP head (drafts {dm.draft_head.get('draft_vocab', dm.vocab_size)} tokens)" if head else
              f"draft {dm.kv_cache.layers}-layer")
    helper = f"prompt lookup, else {helper}" if lookup else helper
    dim, bold, reset = ("\033[2m", "\033[1m", "\033[0m") if out.isatty() else ("", "", "")
    out.write(f"{bold}rlxrt demo{reset}: target {tm.kv_cache.layers}-layer {tm.architecture}, {helper}, k={k}, "
              f"{threads} thread(s), loaded in {load_s:.2f} s\n\n")
    tail = "\n".join(prompt.splitlines()[-6:]) + ("\n" if prompt.endswith("\n") else "")
    out.write(dim + (f"user: {prompt}\nassistant: " if chat else tail) + reset)
    out.flush()
    request = spec.prompt_ids(prompt) if not chat else spec.chat_prompt([{"role": "user", "content": prompt}])
    stop = list(tm.chat["end_of_turn_ids"]) if chat else None
    with spec.stream(request, max_new_tokens=max_new_tokens, stop_token_ids=stop) as s:
        for piece in s:
            out.write(piece)
            out.flush()
    streamed = s.generation
    out.write("\n\n")
    # speed, side by side: plain and speculative alternate, medians of the repeats
    t_plain, t_spec, same = [], [], True
    for _ in range(repeats):
        for name, s, acc in (("plain", plain, t_plain), ("spec", spec, t_spec)):
            t = time.perf_counter()
            g = s.generate(request, max_new_tokens=max_new_tokens, stop_token_ids=stop)
            acc.append((time.perf_counter() - t) / max(1, len(g.token_ids)))
            if name == "plain":
                ref = g.token_ids
            elif g.token_ids != ref:
                same = False
    speedup = statistics.median(t_plain) / statistics.median(t_spec)
    st = streamed.stats
    per_pos = ", ".join(f"{a / d:.2f}" for a, d in zip(st.accepted_per_position, st.drafted_per_position) if d)
    out.write(f"{bold}speculative {1 / statistics.median(t_spec):.0f} tok/s vs plain "
              f"{1 / statistics.median(t_plain):.0f} tok/s: {speedup:.2f}x{reset} "
              f"(medians of {repeats} side-by-side runs of {max_new_tokens} tokens)\n")
    out.write(f"output identical to plain greedy decoding: {'yes' if same else 'NO'}\n")
    out.write(f"acceptance {st.acceptance_rate:.2f} ({st.accepted}/{st.drafted} drafted tokens), "
              f"{st.tokens_per_round:.2f} tokens per round; per position: {per_pos}\n")
    if lookup:
        by = spec.speculator.proposed_by
        out.write(f"rounds drafted by prompt lookup / the {'head' if head else 'draft model'}: {by[0]} / {by[1]} "
                  f"(all runs)\n")
    dec = st.decode_seconds or 1.0
    out.write(f"time: draft {st.draft_seconds / dec:.0%}, target {st.target_seconds / dec:.0%}, "
              f"other {st.overhead_seconds / dec:.0%}; providers {st.providers}\n")
    return {"speedup": speedup, "identical": same, "stats": st.to_dict(), "finish_reason": streamed.finish_reason}
