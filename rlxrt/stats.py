"""Per-request and per-session statistics of speculative decoding.

Vocabulary (vLLM's): per round the draft proposes ``drafted`` tokens, the
target accepts ``accepted`` of them and then emits one more token, recovered
(after a rejection) or bonus (after full acceptance). ``emitted`` counts every
token that reached the output, so ``emitted == accepted + rounds`` until a stop
condition cuts a round short.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    """Tokens in the output (after stop conditions)."""
    bonus: int = 0
    """Rounds in which all drafted tokens were accepted and the bonus row was used."""
    drafted_per_position: list[int] = field(default_factory=list)
    """[k_max]: rounds that drafted a token at position i."""
    accepted_per_position: list[int] = field(default_factory=list)
    """[k_max]: rounds that accepted the token at position i."""
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    """Time in the speculator's propose (its model runs and its Python)."""
    target_seconds: float = 0.0
    """Time in the target's verification passes."""
    run_seconds: float = 0.0
    """Time inside ORT's session.run (target and draft), for the Python overhead share."""
    decode_seconds: float = 0.0
    """Wall time of all rounds (prefill excluded)."""
    providers: dict[str, list[str]] = field(default_factory=dict)
    """Providers each graph actually ran on: {"target": [...], "draft": [...]}."""
    speculator: str = "none"

    def record_round(self, drafted: int, accepted: int, bonus: bool) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.bonus += int(bonus)
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(drafted):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafted tokens per round, the bonus/recovered token NOT counted."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Emitted tokens per round, the bonus/recovered token counted (1.0 for plain decoding)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def overhead_seconds(self) -> float:
        """Decode time neither in the draft nor in the target: the loop, sampling, detokenising."""
        return max(0.0, self.decode_seconds - self.draft_seconds - self.target_seconds)

    @property
    def python_overhead_share(self) -> float:
        """Share of decode time spent outside ORT's session.run."""
        return 1.0 - self.run_seconds / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Emitted tokens per second of decoding (prefill excluded)."""
        return self.emitted / self.decode_seconds if self.decode_seconds else 0.0

    def add(self, other: "RequestStats") -> None:
        """Accumulate another request into this one (session totals)."""
        for name in ("prompt_tokens", "rounds", "drafted", "accepted", "emitted", "bonus", "prefill_seconds",
                     "draft_seconds", "target_seconds", "run_seconds", "decode_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_per_position, other.drafted_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            mine += [0] * (len(theirs) - len(mine))
            for i, v in enumerate(theirs):
                mine[i] += v
        self.providers = dict(other.providers) or self.providers
        self.speculator = other.speculator

    def to_dict(self) -> dict[str, Any]:
        return {
            "speculator": self.speculator, "prompt_tokens": self.prompt_tokens, "rounds": self.rounds,
            "drafted": self.drafted, "accepted": self.accepted, "emitted": self.emitted, "bonus": self.bonus,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "mean_accepted_length_counts_bonus": False,
            "tokens_per_round": round(self.tokens_per_round, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "prefill_seconds": round(self.prefill_seconds, 6), "decode_seconds": round(self.decode_seconds, 6),
            "draft_seconds": round(self.draft_seconds, 6), "target_seconds": round(self.target_seconds, 6),
            "overhead_seconds": round(self.overhead_seconds, 6),
            "python_overhead_share": round(self.python_overhead_share, 4),
            "tokens_per_second": round(self.tokens_per_second, 2), "providers": self.providers,
        }

    def summary(self) -> str:
        return (f"{self.emitted} tokens in {self.rounds} rounds, {self.tokens_per_second:.1f} tok/s; "
                f"acceptance {self.acceptance_rate:.2f} ({self.accepted}/{self.drafted}), "
                f"{self.tokens_per_round:.2f} tokens/round; draft {self.draft_seconds:.3f} s, "
                f"target {self.target_seconds:.3f} s, other {self.overhead_seconds:.3f} s")
