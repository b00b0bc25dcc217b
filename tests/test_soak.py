"""A short soak (20,000 requests over 2,000 tenants, with engine faults, client cancellations and
rate limits): every accepted request ends typed, every index stays within its bound.
``python -m benchmarks.soak`` runs the full million (see benchmarks/README.md)."""

from __future__ import annotations

from benchmarks.soak import run_soak


async def test_every_request_ends_typed_and_every_index_stays_bounded():
    result = await run_soak(requests=20_000, tenants=2_000, clients=256, progress=False)
    checks = dict(result["checks"])
    checks.pop("resident memory grew <= 50 MB after warm-up")  # too short to say; the full soak does
    assert all(checks.values()), (checks, result["violations"][:5])
    counts = result["client_counts"]
    assert sum(counts.values()) == 20_000
    assert counts["typed: EngineError"] > 0 and counts["cancelled by client"] > 0  # faults happened
    assert counts.get("typed: RateLimited", 0) + counts.get("typed: Overloaded", 0) > 0
