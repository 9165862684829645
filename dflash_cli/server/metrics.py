"""Prometheus counters of ``dflash serve`` (``GET /metrics``), one registry per app."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST  # of GET /metrics

disable_created_metrics()  # no *_created series: only the counters people graph

TAU_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0)
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Requests, tokens, drafts and acceptance of one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "dflash_requests", "HTTP requests by endpoint and status code.", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated.", registry=r)
        self.drafted_tokens = Counter("dflash_draft_tokens", "Draft tokens proposed to the target.", registry=r)
        self.accepted_tokens = Counter("dflash_accepted_tokens", "Draft tokens the target accepted.", registry=r)
        self.verify_steps = Counter("dflash_verify_steps", "Target verify forwards after prefill.", registry=r)
        self.generations = Counter("dflash_generations", "Finished generations by reason.", ["reason"], registry=r)
        self.tau = Histogram(
            "dflash_tau", "Mean tokens committed per verify step, per generation.", buckets=TAU_BUCKETS, registry=r
        )
        self.ttft = Histogram("dflash_ttft_seconds", "Time to first token.", buckets=SECONDS_BUCKETS, registry=r)
        self.queue_wait = Histogram(
            "dflash_queue_wait_seconds",
            "Time a request waited for the generation slot.",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.waiting = Gauge("dflash_requests_waiting", "Requests waiting for the generation slot.", registry=r)
        self.running = Gauge("dflash_requests_running", "Generations running (0 or 1).", registry=r)

    def queue_changed(self, waiting: int, running: int) -> None:
        """Keep the queue gauges current."""
        self.waiting.set(waiting)
        self.running.set(running)

    def request(self, endpoint: str, status: int) -> None:
        """Count one answered request."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def generation(self, reason: str, stats: Any, wait_seconds: float) -> None:
        """Add a finished generation's totals."""
        self.generations.labels(reason=reason).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        self.drafted_tokens.inc(stats.drafted_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        self.verify_steps.inc(stats.verify_steps)
        if stats.verify_steps:
            self.tau.observe(stats.tau)
        self.ttft.observe(stats.ttft_seconds)
        self.queue_wait.observe(wait_seconds)

    def skipped(self) -> None:
        """A queued generation whose client left before it started: counted as cancelled."""
        self.generations.labels(reason="cancelled").inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
