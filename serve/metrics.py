"""The server's Prometheus metrics, in the ``specdec_`` namespace (vLLM's names where they overlap).

Engine-side counts (drafted, accepted, γ, occupancy) are added by the engine thread after each
iteration (``observe_iteration``, the ``BatchEngine.observer``); request-side ones (outcome,
tokens, latencies) by the request's handler when it ends. Each server has its own registry.
"""

from __future__ import annotations

from typing import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from specdec.runtime.stats import Iteration

# Request outcomes: finished by a stop token or string, by max_tokens, by the client going away
# (abort), by a server-side failure (error), refused for a full queue (rejected) or refused as
# invalid (invalid: every 4xx).
OUTCOMES = ("stop", "length", "abort", "error", "rejected", "invalid")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, gamma: int, max_batch: int, running: Callable[[], int], waiting: Callable[[], int]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "Requests by outcome: stop, length, abort, error, rejected (queue full), invalid (4xx)", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("specdec_generation_tokens", "Generated tokens", registry=r)
        self.drafts = Counter("specdec_spec_decode_num_drafts", "Verify calls that checked at least one draft token", registry=r)
        self.draft_tokens = Counter("specdec_spec_decode_num_draft_tokens", "Draft tokens proposed and verified", registry=r)
        self.accepted_tokens = Counter("specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.draft_per_pos = Counter("specdec_spec_decode_num_draft_tokens_per_pos", "Draft tokens verified at each position 1..gamma", ["position"], registry=r)
        self.accepted_per_pos = Counter("specdec_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position 1..gamma", ["position"], registry=r)
        self._drafted_at = [self.draft_per_pos.labels(str(i)) for i in range(1, gamma + 1)]  # children, looked up once
        self._accepted_at = [self.accepted_per_pos.labels(str(i)) for i in range(1, gamma + 1)]
        rate = Gauge("specdec_spec_decode_acceptance_rate", "Accepted / drafted tokens since start", registry=r)
        self.totals = (0, 0, 0)  # drafts, drafted, accepted: replaced whole by the engine thread
        rate.set_function(self._acceptance_rate)
        mean = Gauge("specdec_spec_decode_mean_accepted_length", "Tokens per verify call since start: 1 + accepted / drafts (vLLM's mean acceptance length)", registry=r)
        mean.set_function(self._mean_accepted_length)
        self.gamma = Histogram("specdec_spec_decode_gamma", "Draft tokens chosen per row and iteration (0: a plain step)", buckets=tuple(range(gamma + 1)), registry=r)
        self.occupancy = Histogram("specdec_batch_occupancy", "Rows decoded per iteration", buckets=tuple(range(1, max_batch + 1)), registry=r)
        Gauge("specdec_num_requests_running", "Requests holding a batch row", registry=r).set_function(running)
        Gauge("specdec_num_requests_waiting", "Requests queued for a batch row", registry=r).set_function(waiting)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Arrival to first generated token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specdec_inter_token_latency_seconds", "Time between generated tokens (an iteration's gap spread over its tokens)", buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("specdec_e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS, registry=r)

    def observe_iteration(self, its: Sequence[Iteration]) -> None:
        """One engine iteration: one ``Iteration`` per row (called on the engine thread)."""
        self.occupancy.observe(len(its))
        drafts = drafted = accepted = 0
        at_drafted, at_accepted = [0] * len(self._drafted_at), [0] * len(self._accepted_at)
        for it in its:
            self.gamma.observe(it.drafted)
            if it.drafted:
                drafts, drafted, accepted = drafts + 1, drafted + it.drafted, accepted + it.accepted
                for i in range(it.drafted):
                    at_drafted[i] += 1
                    at_accepted[i] += i < it.accepted
        for child, n in zip(self._drafted_at + self._accepted_at, at_drafted + at_accepted):
            if n:
                child.inc(n)
        if drafts:
            self.drafts.inc(drafts)
            self.draft_tokens.inc(drafted)
            self.accepted_tokens.inc(accepted)
            t = self.totals
            self.totals = (t[0] + drafts, t[1] + drafted, t[2] + accepted)

    def prefix_cache(self, engine) -> None:
        """Export the engine's prefix-reuse counts (``Engine.prefix_*``), read at each scrape."""
        self.registry.register(_PrefixCache(engine))

    def replica(self, name: str) -> None:
        """Label this registry with the Ray Serve replica it belongs to."""
        Gauge("specdec_replica_info", "The Ray Serve replica these metrics are from", ["replica"], registry=self.registry).labels(name).set(1)

    def _acceptance_rate(self) -> float:
        _, drafted, accepted = self.totals
        return accepted / drafted if drafted else 0.0

    def _mean_accepted_length(self) -> float:
        drafts, _, accepted = self.totals
        return 1.0 + (accepted / drafts if drafts else 0.0)

    def text(self) -> bytes:
        return generate_latest(self.registry)



class _PrefixCache:
    """vLLM's prefix-cache counters over an ``Engine``'s own counts (the engine thread adds to
    them; a scrape reads ints)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        for name, doc, value in (("queries", "Prompt tokens of requests started", e.prefix_queries),
                                 ("hits", "Prompt tokens not fed: kept in a slot from an earlier request, or copied from a row in flight with the same prompt", e.prefix_hits),
                                 ("evictions", "Cached prefixes overwritten by another request (least recently used first)", e.evictions)):  # fmt: skip
            yield CounterMetricFamily(f"specdec_prefix_cache_{name}", doc, value=value)
        for i, name in enumerate(("queries", "hits")):  # by the class of the requests' cache salt, never by tenant
            family = CounterMetricFamily(f"specdec_prefix_cache_{name}_by_salt_class",
                                         f"Prompt tokens {('of requests started', 'not fed')[i]}, by cache salt class: none, request (the client's "
                                         "cache_salt), tenant (the server's, from the API key)", labels=["salt_class"])  # fmt: skip
            for cls, counts in e.by_salt.items():
                family.add_metric([cls], counts[i])
            yield family
