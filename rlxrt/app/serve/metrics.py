"""Prometheus metrics of one server (its own registry: no process-wide state), named like vLLM's with the
``rlxrt:`` prefix: requests, latency and time-to-first-token histograms, token counters and the speculative
counters (drafts, draft tokens, accepted tokens, accepted tokens per position)."""
from __future__ import annotations

import time

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self, model: str, pool_gauges=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r, labels = self.registry, {"model_name": model}
        self.labels = labels

        def counter(name, doc, extra=()):
            return Counter(name, doc, ["model_name", *extra], registry=r)

        self.requests = counter("rlxrt:request_success", "Requests that ended, by finish reason (stop, length, "
                                "cancelled, timeout, error)", ("finished_reason",))
        self.rejected = counter("rlxrt:request_rejected", "Requests refused before running (queue full: 429)")
        self.prompt_tokens = counter("rlxrt:prompt_tokens", "Prompt tokens of the requests that ran")
        self.generation_tokens = counter("rlxrt:generation_tokens", "Tokens generated")
        self.drafts = counter("rlxrt:spec_decode_num_drafts", "Rounds that drafted at least one token")
        self.draft_tokens = counter("rlxrt:spec_decode_num_draft_tokens", "Tokens drafted")
        self.accepted_tokens = counter("rlxrt:spec_decode_num_accepted_tokens", "Drafted tokens accepted")
        self.accepted_per_pos = counter("rlxrt:spec_decode_num_accepted_tokens_per_pos",
                                        "Drafted tokens accepted at each draft position", ("position",))
        self.latency = Histogram("rlxrt:e2e_request_latency_seconds", "Time from arrival to the last token",
                                 ["model_name"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("rlxrt:time_to_first_token_seconds", "Time from arrival to the first token",
                              ["model_name"], buckets=LATENCY_BUCKETS, registry=r)
        running = Gauge("rlxrt:num_requests_running", "Requests a worker is running", ["model_name"], registry=r)
        waiting = Gauge("rlxrt:num_requests_waiting", "Requests admitted and waiting for a worker", ["model_name"],
                        registry=r)
        if pool_gauges is not None:
            running.labels(**labels).set_function(lambda: pool_gauges().running)
            waiting.labels(**labels).set_function(lambda: pool_gauges().waiting)

    def rejected_one(self) -> None:
        self.rejected.labels(**self.labels).inc()

    def record(self, job, generation) -> None:
        """One request ended (called on its worker thread)."""
        lab = self.labels
        if job.timed_out:
            reason = "timeout"
        elif job.failed:
            reason = "error"
        elif generation is None:
            reason = "cancelled"  # before it ran
        else:
            reason = generation.finish_reason
        self.requests.labels(finished_reason=reason, **lab).inc()
        if generation is None:
            return
        s = generation.stats
        self.prompt_tokens.labels(**lab).inc(len(generation.prompt_token_ids))
        self.generation_tokens.labels(**lab).inc(len(generation.token_ids))
        self.drafts.labels(**lab).inc(s.drafted_per_position[0] if s.drafted_per_position else 0)
        self.draft_tokens.labels(**lab).inc(s.drafted)
        self.accepted_tokens.labels(**lab).inc(s.accepted)
        for i, n in enumerate(s.accepted_per_position):
            self.accepted_per_pos.labels(position=str(i), **lab).inc(n)
        now = time.monotonic()
        self.latency.labels(**lab).observe(now - job.arrived)
        if job.first_token is not None:
            self.ttft.labels(**lab).observe(job.first_token - job.arrived)

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
