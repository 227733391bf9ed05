"""What fixed rows cost plain decoding: tokens a second of plain greedy decoding with ``fixed_rows`` 0 (each
step one row) against 5 and 9, interleaved, medians; and speculation under each (prompt lookup k=4).

    python scripts/fixed_rows_cost.py [TARGET] [--kernels ort|rlxrt|auto] [--tokens 128] [--repeats 3]"""
import argparse
import json
import statistics

import rlxrt
from rlxrt.app.reference import reference_pair, reference_prompts
from rlxrt.sessions import PromptLookup, Session


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", nargs="?", default=str(reference_pair()[0]))
    p.add_argument("--kernels", default="ort")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    prompts = reference_prompts()[:4]
    sessions = {}
    for rows in (0, 5, 9):
        cfg = rlxrt.Config(intra_op_threads=1, cache=False, cpu_kernels=a.kernels, fixed_rows=rows)
        graph = rlxrt.compile(a.target, cfg)
        sessions[f"plain rows={rows}"] = Session(graph, None, cfg)
        sessions[f"lookup k=4 rows={rows}"] = Session(graph, PromptLookup(), cfg, k=4)
    rates = {name: [] for name in sessions}
    for r in range(a.repeats):
        for i, prompt in enumerate(prompts):
            names = list(sessions)
            names = names[(r + i) % len(names):] + names[:(r + i) % len(names)]
            for name in names:
                g = sessions[name].generate(prompt, max_new_tokens=a.tokens, ignore_eos=True)
                rates[name].append(len(g.token_ids) / g.stats.decode_seconds)
    base = statistics.median(rates["plain rows=0"])
    print(json.dumps({name: round(statistics.median(v) / base, 3) for name, v in rates.items()}, indent=1))


if __name__ == "__main__":
    main()
