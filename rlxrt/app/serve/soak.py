"""The soak run of ``rlxrt bench-serve --soak N``: N mixed requests at a fixed concurrency, the server's RSS
sampled as it goes, then every greedy or seeded request that was not cancelled replayed alone and compared."""
from __future__ import annotations

import asyncio
import time
from typing import Any


def run_soak(server, prompts: list[str], n: int, concurrency: int, max_tokens: int, seed: int) -> dict[str, Any]:
    from .loadgen import mixed_bodies

    try:
        server.wait_ready()
        return asyncio.run(_soak(server, mixed_bodies(prompts, n, max_tokens, seed), concurrency))
    finally:
        server.stop()


async def _soak(server, mix, concurrency: int) -> dict[str, Any]:
    import httpx

    from .loadgen import one_request

    sem = asyncio.Semaphore(concurrency)
    rss: list[tuple[int, float]] = [(0, server.rss_mb())]
    done, every = 0, max(1, len(mix) // 80)
    errors: list[str] = []
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def go(body, cancel_after):
            nonlocal done
            async with sem:
                try:
                    r = await one_request(client, server.url, body, cancel_after)
                except Exception as exc:  # recorded, never lost: the report counts them
                    errors.append(f"{type(exc).__name__}: {exc}")
                    r = None
                done += 1
                if done % every == 0:
                    rss.append((done, server.rss_mb()))
                return r

        results = await asyncio.gather(*(go(b, c) for b, c in mix))
        wall = time.perf_counter() - start
        await asyncio.sleep(0.5)  # cancelled requests end at their worker's next round
        health = (await client.get(f"{server.url}/health")).json()
        replay, mismatches = 0, []
        for i, ((body, _), r) in enumerate(zip(mix, results)):
            if r is None or r.cancelled:
                continue
            alone = await one_request(client, server.url, body)
            replay += 1
            if alone.text != r.text:
                mismatches.append({"request": i, "body": body, "served": r.text[:80], "alone": alone.text[:80]})
        metrics = (await client.get(f"{server.url}/metrics")).text
    warm = rss[min(len(rss) - 1, max(1, len(rss) // 5))][1]  # after a fifth of the run
    cancelled = sum(1 for r in results if r is not None and r.cancelled)
    return {"requests": len(mix), "concurrency": concurrency, "seconds": round(wall, 2),
            "streaming": sum(1 for b, _ in mix if b["stream"]),
            "greedy": sum(1 for b, _ in mix if not b["temperature"]),
            "closed_early_by_client": cancelled, "errors": len(errors), "error_samples": errors[:5],
            "replayed_alone": replay, "mismatches": len(mismatches), "mismatch_samples": mismatches[:5],
            "workers_idle_after": health["running"] == 0 and health["waiting"] == 0,
            "cancelled_by_server": _cancelled(metrics),
            "note": "closed_early_by_client counts streams the client closed after 1-3 chunks; cancelled_by_server "
                    "those the server ended early (a short request may have finished before the client closed it)",
            "rss_mb_after_warmup": round(warm, 1), "rss_mb_end": round(rss[-1][1], 1),
            "rss_growth_mb": round(rss[-1][1] - warm, 1), "rss_mb": [(k, round(v, 1)) for k, v in rss]}


def _cancelled(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("rlxrt:request_success_total") and 'finished_reason="cancelled"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
