"""``rlxrt bench``: plain vs speculative decoding (and peers) on held-out prompts, side by side.

Every configuration runs each prompt in every repeat, in an order rotated per
repeat, so that machine noise hits all of them alike; figures are medians and
speedups are ratios of times measured next to each other.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass
class Spec:
    name: str
    make: Callable[[], Any]
    """Builds the speculator (None for plain decoding)."""
    k: int | None = None
    adaptive: bool = False


class Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled, self.t0 = total, 0, enabled and total > 0, time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / self.total
        bar = "#" * int(30 * frac)
        eta = (time.perf_counter() - self.t0) / self.done * (self.total - self.done)
        sys.stderr.write(f"\r[{bar:<30}] {self.done}/{self.total} {label[:28]:<28} eta {eta:4.0f} s")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()



def head_labels(heads: list[Path]) -> list[str]:
    """A distinct row label for each head: the shortest tail of its path that no other head shares (two heads in
    directories both named ``head`` would otherwise share their rows, and one would be measured in silence)."""
    parts = [Path(h).resolve().parts for h in heads]
    labels = []
    for i, p in enumerate(parts):
        n = 1
        while n < len(p) and any(q != p and q[-n:] == p[-n:] for q in parts):  # the same head twice: #2 below
            n += 1
        label = "/".join(p[-n:])
        labels.append(label if label not in labels else f"{label}#{labels.count(label) + 1}")
    return labels

def analytic_speedup(tokens_per_round: float, t_round: float, t1: float) -> float:
    """The speedup a loop with no overhead would reach: tokens_per_round * T(1) / T(round).

    T(round) = k T_draft + T_target(k+1) is taken from the model calls of the run
    itself (so cache interference between draft and target is counted as it
    is), T(1) from the plain run beside it, and tokens_per_round is measured (so
    acceptance that decays along the draft counts as it does).
    """
    return tokens_per_round * t1 / t_round if t_round > 0 else float("nan")


SPREAD = 8
"""Positions the step-time probe rotates over."""


def step_times(target, draft, ks: list[int], context: int, repeats: int = 60,
               text: list[int] | None = None) -> dict[str, float]:
    """Median seconds of one draft step, one target step, and a target pass over k+1 tokens.

    ``text`` (token ids the target wrote; repeated as needed) is the context and the tokens fed after it, so
    that a greedy head meets the hidden states of real text; without it, ids 0, 1, 2, … Repeats rotate over
    the last ``SPREAD`` positions of the context (a head's cost depends on the position it meets).

    The passes are interleaved (one of each per repeat) so that machine noise hits them alike; a draft step
    measured so follows a target step, which has pushed the draft's weights out of the caches. ``draft_round``
    is a draft step as a round has them: the mean of max(ks) draft steps in a row after a target step.
    """
    import numpy as np

    passes = [("target_1", target, 1, False)] + ([("draft_1", draft, 1, False)] if draft is not None else [])
    passes += [(f"target_{k + 1}", target, k + 1, False) for k in ks]
    if target.greedy_ids:  # what a greedy round runs on a graph with a greedy head: ids, no logits
        passes += [(f"target_ids_{n}", target, n, True) for n in [1] + [k + 1 for k in ks]]
    ahead = max([1, *ks]) + 1
    if text and len(text) >= SPREAD + ahead:  # inside the text: a seam where it repeats is no real context
        context = min(context, len(text) - ahead)
    context = max(SPREAD, context)
    longest = context + ahead
    stream = np.resize(np.asarray(text, np.int64), longest) if text else np.arange(longest)
    for model in {id(m): m for _, m, _, _ in passes}.values():
        model.reset()
        model.forward(stream[:context] % model.vocab_size, rows=1)
    vocab = {id(m): m.vocab_size for _, m, _, _ in passes}
    times: dict[str, list[float]] = {name: [] for name, _, _, _ in passes}
    for r in range(repeats):
        at = context - r % SPREAD
        for name, model, s, greedy in passes:
            model.commit(at)
            call, fed = (model.forward_ids if greedy else model.forward), stream[at:at + s] % vocab[id(model)]
            t0 = time.perf_counter()
            call(fed)
            times[name].append(time.perf_counter() - t0)
    if draft is not None:
        times["draft_round"] = []
        for _ in range(repeats):
            target.commit(context)
            target.forward(stream[context:context + 1] % target.vocab_size)
            t0 = time.perf_counter()
            for j in range(max(ks)):
                draft.commit(context + j)
                draft.forward(stream[context:context + 1] % draft.vocab_size)
            times["draft_round"].append((time.perf_counter() - t0) / max(ks))
    return {name: statistics.median(ts) for name, ts in times.items()}


def run_bench(target_dir: Path, draft_dir: Path | None, prompts: list[str], *, max_new_tokens: int = 128,
              repeats: int = 3, temperatures=(0.0, 0.7), ks=(2, 4, 6), config=None,
              hf_dirs: tuple[Path, Path] | None = None, progress: bool = True,
              head_dir: Path | list[Path] | None = None, oga_dirs: tuple[Path, Path | None] | None = None,
              other_target: Path | None = None, other_draft: Path | None = None, chat: bool = False,
              min_prob: float | None = None) -> dict[str, Any]:
    """``config`` (an ``rlxrt.Config``; default: 1 intra-op thread on the CPU) is used for every graph.
    ``hf_dirs`` adds transformers on the same weights, ``oga_dirs`` (target, draft) onnxruntime-genai's model
    directories of the same weights (greedy rows only: plain, draft, n-gram); ``other_target`` another export
    of the target (e.g. the portable graph of the same weights) whose plain decoding runs as one more row;
    ``other_draft`` another draft (e.g. the same draft in int8) whose rows ``LABEL draft k=K`` run beside the
    draft's, LABEL its dtype where that differs from the draft's, else its directory's name.
    ``min_prob`` runs every draft and head row once more with that ``min_prob`` (rows named ``... p>=P``).
    ``chat`` sends each prompt as a user message through the target's chat template, and a reply ends at the
    end-of-turn token (times are per generated token); otherwise every request makes ``max_new_tokens``."""
    from rlxrt.backends import compile
    from rlxrt.backends.compile import cpu_model  # the same graphs speculate differently on other CPUs
    from rlxrt.config import Config
    from rlxrt.limits import K_MAX
    from rlxrt.sessions import DraftModel, MtpHead, PromptLookup, Session

    from .speculators import build

    config = config if config is not None else Config(intra_op_threads=1, providers=("cpu",))
    threads = config.intra_op_threads

    target_graph = compile(target_dir, config)
    draft_graph = compile(draft_dir, config) if draft_dir else None
    graphs = [target_graph, draft_graph]
    specs = [Spec("plain", lambda: None)]
    probs_ = [0.0] + ([min_prob] if min_prob else [])

    def suffix(p):
        return f" p>={p:g}" if p else ""

    if draft_graph is not None:
        specs += [Spec(f"draft k={k}{suffix(p)}", lambda p=p: DraftModel(draft_graph, min_prob=p), k=k)
                  for p in probs_ for k in ks]
        specs.append(Spec("draft adaptive", lambda: DraftModel(draft_graph), k=max(ks) // 2 or 1, adaptive=True))
    if other_draft is not None:
        from rlxrt.errors import UsageError

        if draft_graph is None:
            raise UsageError("--other-draft runs beside a draft; pass --draft too")
        graphs.append(compile(other_draft, config))
        om = graphs[-1].manifest
        words = [om.dtype] if om.dtype != draft_graph.manifest.dtype else []
        if om.draft_vocab:
            words.append(f"vocab {om.draft_vocab['size']}")
        label = " ".join(words) or Path(other_draft).name
        specs += [Spec(f"{label} draft k={k}", lambda g=graphs[-1]: DraftModel(g), k=k) for k in ks]
    heads = [] if head_dir is None else [Path(head_dir)] if isinstance(head_dir, (str, Path)) else list(head_dir)
    for hd, label in zip(heads, head_labels(heads)):  # several heads: rows named after each head's directory
        head_graph = compile(hd, config)
        graphs.append(head_graph)
        tag = f"mtp[{label}]" if len(heads) > 1 else "mtp"
        specs += [Spec(f"{tag} k={k}{suffix(p)}", lambda g=head_graph, p=p: MtpHead(g, min_prob=p), k=k)
                  for p in probs_ for k in ks]
        specs += [Spec(f"lookup+{tag} k={k}{suffix(p)}", lambda g=head_graph, p=p: build("lookup+mtp", g, None, p), k=k)
                  for p in probs_ for k in ks]
        specs += [Spec(f"{tag} adaptive", lambda g=head_graph: MtpHead(g), k=max(ks) // 2 or 1, adaptive=True),
                  Spec(f"lookup+{tag} adaptive", lambda g=head_graph: build("lookup+mtp", g, None), k=max(ks) // 2 or 1,
                       adaptive=True)]
    specs.append(Spec("prompt lookup k=4", lambda: PromptLookup(), k=4))
    sessions = {s.name: Session(target_graph, s.make(), k=s.k, adaptive_k=s.adaptive, k_max=min(max(ks) + 2, K_MAX))
                for s in specs}
    assert len(sessions) == len(specs), "two bench rows share a name"
    if other_target is not None:
        graphs.append(compile(other_target, config))
        other = Session(graphs[-1])
        kind = other.manifest.graph_kind  # another graph kind, or the same kind as another variant (its directory)
        label = kind if kind != sessions["plain"].manifest.graph_kind else Path(other_target).name
        sessions[f"{label} plain"] = other
    until = {"ignore_eos": True}
    if chat:
        from rlxrt.errors import UsageError

        plain = sessions["plain"]
        if not plain.has_chat_template:
            raise UsageError(f"--chat: {target_dir} has no chat template; drop --chat")
        prompts = [plain.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
        until = {"stop_token_ids": list(plain.manifest.chat["end_of_turn_ids"])}
    peers = {}  # row name -> the peer that runs it
    if hf_dirs is not None:
        from rlxrt.exporters.peers import HFPeers

        hf = HFPeers(hf_dirs[0], hf_dirs[1], threads=threads or 1)
        peers.update({n: hf for n in hf.names})
    oga_names: list[str] = []
    if oga_dirs is not None:
        from .oga import OgaPeers

        plain_codec = sessions["plain"].codec
        oga = OgaPeers(oga_dirs[0], oga_dirs[1], threads=threads or 1,
                       encode=plain_codec.encode if plain_codec is not None else None)
        oga_names = oga.names
        peers.update({n: oga for n in oga.names})
    names = list(sessions) + list(peers)
    total = sum(len([n for n in names if t == 0 or n not in oga_names]) for t in temperatures) * repeats * len(prompts)
    bar = Progress(total, progress)
    # directory names only: results are shared, and carry no path of the machine that made them
    results: dict[str, Any] = {"config": {"target": Path(target_dir).name,
                                          "draft": Path(draft_dir).name if draft_dir else None,
                                          "other_draft": Path(other_draft).name if other_draft else None,
                                          "head": ",".join(h.name for h in heads) or None,
                                          "prompts": len(prompts), "max_new_tokens": max_new_tokens,
                                          "repeats": repeats, "threads": threads,
                                          "providers": list(target_graph.providers), "ks": list(ks),
                                          "chat": chat, "min_prob": min_prob or 0.0, "cpu": cpu_model(),
                                          "huge_pages": [g.huge_pages.wait() for g in graphs if g is not None],
                                          "cpu_kernels": [g.cpu_kernels for g in graphs if g is not None]},
                               "temperatures": {}}
    prompt_lens: list[int] = []
    for s in sessions.values():  # warm-up: first runs allocate
        s.generate(prompts[0], max_new_tokens=8, ignore_eos=True)
    if oga_names:  # the peer decodes the same weights: its greedy output must be rlxrt's
        want = [sessions["plain"].generate(p, max_new_tokens=max_new_tokens, ignore_eos=True).token_ids
                for p in prompts]
        results["oga_greedy_equals_rlxrt"] = {n: all(oga.generate(n, p, max_new_tokens)[1] == w
                                                     for p, w in zip(prompts, want)) for n in oga_names}
    for temp in temperatures:
        names_t = [n for n in names if temp == 0 or n not in oga_names]  # the peer rows are greedy only
        times: dict[str, list[list[float]]] = {n: [[] for _ in prompts] for n in names_t}
        stats: dict[str, list] = {n: [] for n in names_t}
        for rep in range(repeats):
            order = names_t[rep % len(names_t):] + names_t[:rep % len(names_t)]
            for pi, prompt in enumerate(prompts):
                for name in order:
                    if name in sessions:
                        t0 = time.perf_counter()
                        g = sessions[name].generate(prompt, max_new_tokens=max_new_tokens, temperature=temp,
                                                    seed=rep * 1000 + pi, **until)
                        dt = time.perf_counter() - t0
                        times[name][pi].append(dt / max(1, len(g.token_ids)))
                        stats[name].append(g.stats)
                        prompt_lens.append(len(g.prompt_token_ids))
                    else:
                        dt, n_tok = peers[name].run(name, prompt, max_new_tokens, temp, seed=rep * 1000 + pi)
                        times[name][pi].append(dt / max(1, n_tok))
                    bar.step(f"T={temp} {name}")
        results["temperatures"][str(temp)] = _summarise(names_t, times, stats)
    draft_model = sessions[specs[1].name].speculator.model if draft_graph is not None else None
    # step times at the middle of a typical request's context
    mid = statistics.median(prompt_lens) + max_new_tokens // 2 if prompt_lens else 256
    context = int(min(mid, sessions["plain"].manifest.max_positions - max(ks) - 2))
    heads = {id(x.target): x.target for x in sessions.values() if x.target.greedy_ids}
    if heads:  # how often the greedy heads' bound certified a row in the decoding above
        results["greedy_head"] = {"rows": sum(t.greedy_rows for t in heads.values()),
                                  "fallback_rows": sum(t.greedy_fallbacks for t in heads.values())}
    last = sessions["plain"].last  # the text the target wrote last: real hidden states for a greedy head
    text = (last.prompt_token_ids + last.token_ids) if last is not None else None
    st = step_times(sessions["plain"].target, draft_model, list(ks), context=context, text=text)
    results["config"]["step_time_context"] = context
    results["step_times_s"] = st
    for temp_res in results["temperatures"].values():
        t1 = temp_res["plain"]["model_seconds_per_round"]
        for name, row in temp_res.items():
            if name == "plain" or "model_seconds_per_round" not in row:
                continue
            bound = analytic_speedup(row["tokens_per_round"], row["model_seconds_per_round"], t1)
            row["analytic_bound"] = round(bound, 3)
            row["efficiency"] = round(row["speedup"] / bound, 3)
    return results


def _summarise(names, times, stats) -> dict[str, Any]:
    out = {}
    base = times["plain"]
    for name in names:
        per_tok = [t for row in times[name] for t in row]
        ratios = [b / t for brow, trow in zip(base, times[name]) for b, t in zip(brow, trow)]
        row: dict[str, Any] = {"tokens_per_s": round(1.0 / statistics.median(per_tok), 1),
                               "speedup": round(statistics.median(ratios), 3)}
        if stats[name]:
            from rlxrt.stats import RequestStats

            tot = RequestStats()
            for s in stats[name]:
                tot.add(s)
            d = tot.to_dict()
            row.update({key: d[key] for key in ("acceptance_rate", "mean_accepted_length", "tokens_per_round",
                                                "accepted_per_position", "drafted_per_position",
                                                "python_overhead_share")})
            dec = tot.decode_seconds or 1.0
            row["model_seconds_per_round"] = (tot.draft_seconds + tot.target_seconds) / max(1, tot.rounds)
            row["time_split"] = {"draft": round(tot.draft_seconds / dec, 3),
                                 "target": round(tot.target_seconds / dec, 3),
                                 "other": round(tot.overhead_seconds / dec, 3)}
        out[name] = row
    return out


def format_table(results: dict[str, Any]) -> str:
    lines = []
    for temp, rows in results["temperatures"].items():
        lines.append(f"temperature {temp}")
        lines.append(f"  {'config':<20} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'tok/rnd':>8} "
                     f"{'bound':>6} {'eff':>5}  split d/t/o")
        for name, r in rows.items():
            split = r.get("time_split")
            lines.append(
                f"  {name:<20} {r['tokens_per_s']:>8.1f} {r['speedup']:>7.2f}x "
                f"{r.get('acceptance_rate', float('nan')):>7.2f} {r.get('tokens_per_round', float('nan')):>8.2f} "
                f"{r.get('analytic_bound', float('nan')):>6.2f} {r.get('efficiency', float('nan')):>5.2f}  "
                + (f"{split['draft']:.2f}/{split['target']:.2f}/{split['other']:.2f}" if split else "-"))
    if "oga_greedy_equals_rlxrt" in results:
        lines.append("onnxruntime-genai greedy output == rlxrt's: " + ", ".join(
            f"{n} {'yes' if ok else 'NO'}" for n, ok in results["oga_greedy_equals_rlxrt"].items()))
    st = results.get("step_times_s", {})
    if st:
        parts = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in st.items())
        lines.append(f"step times (median, interleaved, context {results['config'].get('step_time_context')}): "
                     f"{parts}")
        for kind, prefix in (("logits", "target_"), ("greedy ids", "target_ids_")):
            rows = sorted(int(k[len(prefix):]) for k in st if k.startswith(prefix) and k[len(prefix):].isdigit())
            if len(rows) > 1:
                lines.append(f"T(k+1)/T(1), {kind}: " + ", ".join(
                    f"T({n})/T(1) {st[prefix + str(n)] / st[prefix + '1']:.2f}" for n in rows[1:]))
        head = results.get("greedy_head")
        if head and head["rows"]:
            lines.append(f"greedy head: {head['rows']} rows decoded, {1 - head['fallback_rows'] / head['rows']:.1%} "
                         f"certified by its bound ({head['fallback_rows']} took the full Gemm)")
        if "target_ids_1" in st:
            lines.append(f"greedy head: a one-row step in {st['target_ids_1'] / st['target_1']:.2f} of the logits step's "
                         "time")
        if "draft_1" in st:
            line = f"draft/target step time ratio: {st['draft_1'] / st['target_1']:.3f} after a target step"
            if "draft_round" in st:
                k = max(results["config"].get("ks") or [1])
                line += f", {st['draft_round'] / st['target_1']:.3f} in a round of {k} draft steps"
            lines.append(line)
    return "\n".join(lines)


def write_outputs(results: dict[str, Any], out_dir: Path) -> tuple[Path, Path | None]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "bench.json"
    js.write_text(json.dumps(results, indent=2) + "\n")
    png = None
    try:
        from .chart import bench_chart

        png = bench_chart(results, out_dir / "bench.png")
    except ImportError:
        pass
    return js, png
