"""How often a draft's tokens are accepted when its catch-ups read only the last N tokens of the text.

    python scripts/catch_up_acceptance.py [--target DIR --draft DIR] [--catch-up all,256,128,64,32,16] \
        [--prompts 16] [--tokens 128] [-k 2]

Each value of N runs the same greedy requests (the shipped prompts) with ``DraftModel(draft, catch_up=N)`` and
prints the acceptance (accepted / drafted tokens) and tokens a round. Alone, a Session drafts every round, so
the only catch-up is its first proposal's read of the prompt: the figure says what a draft loses by reading only
the last N tokens of a text, which is what a batch's draft reads after rounds it did not draft.
"""
from __future__ import annotations

import argparse
import sys


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--catch-up", default="all,256,128,64,32,16")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=2)
    args = p.parse_args()

    import rlxrt
    from rlxrt.app.flags import prompts_of
    from rlxrt.app.reference import reference_pair
    from rlxrt.sessions import DraftModel, Session

    pair = reference_pair()
    target, draft = args.target or str(pair[0]), args.draft or str(pair[1])
    config = rlxrt.Config(cpu_kernels="rlxrt")
    texts = prompts_of(argparse.Namespace(prompt_file=None), args.prompts)
    print("| catch_up | acceptance | tokens a round |\n| --- | --- | --- |")
    for value in args.catch_up.split(","):
        n = None if value == "all" else int(value)
        session = Session(target, DraftModel(draft, config, catch_up=n), config, k=args.k)
        accepted = drafted = rounds = emitted = 0
        for text in texts:
            g = session.generate(session.prompt_ids(text), max_new_tokens=args.tokens, ignore_eos=True)
            accepted, drafted = accepted + g.stats.accepted, drafted + g.stats.drafted
            rounds, emitted = rounds + g.stats.rounds, emitted + len(g.token_ids)
        print(f"| {value} | {accepted / max(drafted, 1):.3f} | {emitted / max(rounds, 1):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
