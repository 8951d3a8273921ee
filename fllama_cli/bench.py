"""`fllama bench`: prefill / decode throughput, latency and memory against the bandwidth floor and a torch baseline."""

from __future__ import annotations

from model_zoo.errors import FllamaError


def bench_cmd() -> None:
    """Benchmark the GPU engine (fp16, int8, awq) against the bandwidth floor and torch.compile."""
    raise FllamaError("fllama bench is not built yet")
