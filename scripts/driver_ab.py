"""Sessions on a Batch run by one thread each against the same Sessions as tasks of one Driver, in process.

N Sessions (plain, or drafting with the shipped draft on its own Batch), each running R requests one after the
other; each mode has its own Batches; repeats interleave the modes; it prints each mode's median tokens/s, the
driver's paired ratio to the threads (each repeat's ratio, median and range), the guards, and whether every
output of the two modes was the same.

    python scripts/driver_ab.py --sessions 8 --requests 3 --repeats 4 [--draft -k 2]
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--requests", type=int, default=3, help="requests each Session runs in turn")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--draft", action="store_true", help="draft with the shipped draft on its own Batch")
    p.add_argument("-k", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of the steps")
    args = p.parse_args()

    import rlxrt
    from rlxrt.app.flags import prompts_of
    from rlxrt.app.reference import reference_pair
    from rlxrt.app.speculators import build
    from rlxrt.sessions import Batch, Driver, Session

    target, draft = (str(d) for d in reference_pair())
    config = rlxrt.Config(intra_op_threads=args.threads, cpu_kernels="rlxrt")
    n, modes = args.sessions, ("threads", "driver")
    batches = {m: Batch(target, config, slots=n) for m in modes}
    drafts = {m: Batch(draft, config, slots=n, calibrate=False) for m in modes} if args.draft else {}
    sessions = {m: [Session(batches[m], build("draft", drafts[m], config) if drafts else None, config, k=args.k)
                    for _ in range(n)] for m in modes}
    texts = prompts_of(argparse.Namespace(prompt_file=None), 64)
    prompts = [sessions["threads"][0].prompt_ids(t) for t in texts]
    outputs: dict[tuple, list] = {}

    def run(mode: str, rep: int) -> float:
        tokens = [0] * n

        def client(c):
            for r in range(args.requests):
                g = sessions[mode][c].generate(prompts[(rep * 7 + c * args.requests + r) % len(prompts)],
                                               max_new_tokens=args.tokens, ignore_eos=True)
                tokens[c] += len(g.token_ids)
                outputs.setdefault((rep, c, r), []).append(g.token_ids)

        t0 = time.perf_counter()
        if mode == "threads":
            threads = [threading.Thread(target=client, args=(c,)) for c in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            driver = Driver()
            for c in range(n):
                driver.spawn(client, c)
            driver.run()
            driver.close()
        return sum(tokens) / (time.perf_counter() - t0)

    for mode in modes:  # warm-up
        run(mode, -1)
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            rates[mode].append(run(mode, rep))
    ratios = [d / t for d, t in zip(rates["driver"], rates["threads"])]
    for mode in modes:
        print(f"{mode:8s} {statistics.median(rates[mode]):8.1f} tok/s  guards {batches[mode].report()['guards']}")
    print(f"driver / threads, paired: {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")
    same = all(all(o == out[0] for o in out) for out in outputs.values())
    print("every output the same in both modes:", same)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
