"""The server's Prometheus metrics (GET /metrics): requests and tokens counted, the queue and the batch as gauges,
time to first token and inter-token latency as histograms. One registry per server, so several servers in one
process (the tests) count apart. The scheduler's thread reports through the Observer methods."""

from __future__ import annotations

import time
from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from model_zoo.ticket import Ticket

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Counters and histograms of one server; an Observer of its scheduler."""

    def __init__(self, max_batch: int):
        disable_created_metrics()  # no *_created series: they double the text and nobody graphs them
        r = self.registry = CollectorRegistry()
        self.requests = Counter("fllama_requests", "Requests that ended, by finish reason (stop, "
                                "length, cancelled, error)", ["finish_reason"], registry=r)
        self.rejected = Counter("fllama_requests_rejected", "Requests answered with an error status before "
                                "generating", ["status"], registry=r)
        self.prompt_tokens = Counter("fllama_prompt_tokens", "Prompt tokens of requests that ended", registry=r)
        self.generation_tokens = Counter("fllama_generation_tokens", "Tokens generated (end-of-sequence included)",
                                         registry=r)
        self.running = Gauge("fllama_requests_running", "Requests holding a KV-cache slot (prefilling or "
                             "decoding)", registry=r)
        self.waiting = Gauge("fllama_requests_waiting", "Requests queued for a slot", registry=r)
        self.occupancy = Gauge("fllama_batch_occupancy", "Busy slots over --max-batch (0..1)", registry=r)
        Gauge("fllama_max_batch", "KV-cache slots (--max-batch)", registry=r).set(max_batch)
        self.ttft = Histogram("fllama_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("fllama_inter_token_latency_seconds", "Between two tokens of one request",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("fllama_request_duration_seconds", "From a request's arrival to its end",
                             buckets=E2E_BUCKETS, registry=r)
        self.max_batch = max_batch

    # -- the scheduler's Observer -------------------------------------------------------------------------
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def token_gaps(self, seconds: Sequence[float]) -> None:
        for s in seconds:
            self.itl.observe(s)

    def finished(self, ticket: Ticket) -> None:
        reason = {"eos": "stop"}.get(ticket.finish_reason or "", ticket.finish_reason or "error")
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(ticket.usage.prompt_tokens)
        self.generation_tokens.inc(ticket.usage.completion_tokens)
        if ticket.first_token_at is not None:
            self.e2e.observe(time.perf_counter() - ticket.submitted)

    def load(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.occupancy.set(running / self.max_batch)

    # -- the server's own ----------------------------------------------------------------------------------
    def reject(self, status: int) -> None:
        self.rejected.labels(status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
