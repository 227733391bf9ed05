"""SmolLM2 with the shipped head: fixed k against adaptive k, under the cost rule and under the previous rule
(k + 2 after a fully accepted round, k - 1 after a rejection), interleaved, the 16 held-out chat prompts, 128
tokens, greedy then T=0.7. ``python scripts/k_rules.py`` (the SmolLM2 recipe's target must be built; about 10
minutes). Greedy outputs are checked equal across rows."""
import json
import os

from rlxrt.app.speculators import build
from rlxrt.backends import compile
from rlxrt.config import Config
from rlxrt.sessions import MtpHead, Session
from rlxrt.sessions.k_choice import KChoice

PROMPTS = "exporters/reference/results/heads/smollm2-chat-prompts16.json"


class Previous(KChoice):
    """The rule adaptive_k had before: k + 2 after a fully accepted round, k - 1 after a rejection."""

    def observe(self, drafted, accepted, seconds, source=0):
        k = self.ks[source]
        if drafted == k:
            self.ks[source] = min(self.k_max, k + 2) if accepted == drafted else max(1, k - 1)
        return self.k


cfg = Config(providers=("cpu",), intra_op_threads=1)
target = compile(os.path.expanduser("~/.cache/rlxrt/smollm2/target"), cfg)
head = compile("rlxrt/assets/smollm2/head", cfg)
target.huge_pages.wait()


def session(kind, k, rule=None):
    spec = None if kind == "plain" else MtpHead(head) if kind == "mtp" else build("lookup+mtp", head, None)
    s = Session(target, spec, k=k, adaptive_k=rule is not None, k_max=6)
    if rule == "previous":
        s._k_choice = Previous(k, 6, spec.drafters)
    return s


rows = {"plain": session("plain", 1), "mtp k=2": session("mtp", 2), "mtp cost": session("mtp", 2, "cost"),
        "mtp previous": session("mtp", 2, "previous"), "lookup+mtp k=2": session("lookup+mtp", 2),
        "lookup+mtp k=4": session("lookup+mtp", 4), "lookup+mtp cost": session("lookup+mtp", 2, "cost"),
        "lookup+mtp previous": session("lookup+mtp", 2, "previous")}
plain = rows["plain"]
with open(PROMPTS) as fh:
    prompts = [plain.chat_prompt([{"role": "user", "content": p}]) for p in json.load(fh)]
stop = list(plain.manifest.chat["end_of_turn_ids"])
for s in rows.values():
    s.generate(prompts[0], max_new_tokens=8, ignore_eos=True)
for temperature in (0.0, 0.7):
    total = {name: [0.0, 0] for name in rows}
    greedy = {}
    for i, q in enumerate(prompts):
        for name, s in rows.items():
            g = s.generate(q, max_new_tokens=128, temperature=temperature, seed=i, stop_token_ids=stop)
            total[name][0] += g.stats.decode_seconds
            total[name][1] += g.stats.emitted
            if temperature == 0.0:
                assert g.token_ids == greedy.setdefault(i, g.token_ids), name
    base = total["plain"][1] / total["plain"][0]
    print(f"T={temperature}: " + ", ".join(f"{n} {t[1] / t[0] / base:.3f}x" for n, t in total.items()))
    print("  final ks:", {n: s._k_choice.ks for n, s in rows.items() if s._k_choice is not None})
