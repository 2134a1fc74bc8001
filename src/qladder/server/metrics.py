"""The server's Prometheus metrics (prometheus-client), in a registry of its own.

Counters of the engine's events are fed by `observe`, an observer the engine calls on its own
threads for every event of every request, so a client that went away is still counted; pool
state (slots, queues, breakers, quarantine) is read when /metrics is scraped. prometheus-client's
metrics take their own locks: any thread may update them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from qladder.audit import AuditRecord
from qladder.server.breaker import MODE_VALUE, Breaker, BreakerMode
from qladder.server.quarantine import Quarantine
from qladder.server.shared_state import StateSync
from qladder.serving.endpoint_watch import Alarm
from qladder.types import Event, FinalEvent, HandoffEvent, HazardEvent, TokenEvent

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
def _mode_value(b: Breaker) -> float:
    return float(MODE_VALUE[b.mode])


AGREEMENT_BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)
KL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
EXCESS_BUCKETS = (-1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
TOKEN_BUCKETS_S = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series: a scrape is read by people and by the load bench
        self.registry = r = CollectorRegistry()
        self.requests = Counter("qladder_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.tokens = Counter("qladder_tokens", "Completion tokens by the rung that produced them", ["rung"],
                              registry=r)
        self.hazards = Counter("qladder_hazards", "Guard hazards by check and rung", ["check", "rung"], registry=r)
        self.handoffs = Counter("qladder_handoffs", "Mid-answer handoffs", ["from_rung", "to_rung"], registry=r)
        self.handoff_latency = Histogram("qladder_handoff_latency_seconds",
                                         "Hazard detected -> first healthy logits on the next rung",
                                         buckets=LATENCY_BUCKETS_S, registry=r)
        self.ttft = Histogram("qladder_ttft_seconds", "Time to first token (admission to first accepted token)",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.first_text = Histogram("qladder_first_text_seconds", "Time to first text (admission to the first "
                                    "released text: the first token plus what the checks held back)",
                                    buckets=LATENCY_BUCKETS_S, registry=r)
        self.per_token = Histogram("qladder_time_per_token_seconds", "Time between accepted tokens",
                                   buckets=TOKEN_BUCKETS_S, registry=r)
        self.finishes = Counter("qladder_finishes", "Finished requests by qladder's finish reason",
                                ["reason"], registry=r)
        self.routes = Counter("qladder_routes", "New requests by the pool they started on and why",
                              ["pool", "reason"], registry=r)
        self.state_shared = Gauge("qladder_state_shared", "0 while a gateway with shared state serves on its local "
                                  "view (its last sync failed to reach the store); 1 otherwise", registry=r)
        self.state_shared.set(1)
        self.breaker_state = Gauge("qladder_breaker_state", "Circuit breaker per pool: 0 closed, 1 half-open, 2 open",
                                   ["pool"], registry=r)
        self.breaker_transitions = Counter("qladder_breaker_transitions", "Breaker mode changes",
                                           ["pool", "to"], registry=r)
        self.incidents_committed = Counter("qladder_incidents_committed", "Incident rows committed to the store",
                                           registry=r)
        self.quarantine_added = Counter("qladder_quarantine_added", "Prompt fingerprints quarantined", registry=r)
        self.rejected = Counter("qladder_rejected", "Requests refused before any token, by reason",
                                ["reason"], registry=r)
        self.audit_agreement = Histogram("qladder_audit_agreement", "Drift audit: INT4's top-1 agreement with "
                                         "full precision over an answer (source: what chose it for the audit)",
                                         ["prompt_class", "pool", "source"],
                                         buckets=AGREEMENT_BUCKETS, registry=r)
        self.audit_kl = Histogram("qladder_audit_kl_top5", "Drift audit: mean KL(INT4 || fp32) over INT4's "
                                  "top 5 tokens, per answer", ["prompt_class", "pool", "source"], buckets=KL_BUCKETS,
                                  registry=r)
        self.audit_excess = Histogram("qladder_audit_excess_nats", "Drift audit: fp32's mean excess surprise "
                                      "at INT4's tokens (-log p - H(p), nats), per answer: <= 0 on average when "
                                      "clean, large when INT4 writes what fp32 would not say",
                                      ["prompt_class", "pool", "source"], buckets=EXCESS_BUCKETS, registry=r)
        self.audit_diverged = Counter("qladder_audit_answers", "Drift audit: answers scored, and whether "
                                      "INT4 left full precision's argmax anywhere",
                                      ["prompt_class", "pool", "source", "diverged"], registry=r)
        self.endpoint_alarms = Counter("qladder_endpoint_alarms", "The audit's test on an INT4 endpoint "
                                       "(health/detector.py): ejected (its CUSUM reached the bound) and "
                                       "returned (clean probes)", ["endpoint", "what"], registry=r)
        self.verify = Counter("qladder_verified", "Verified decoding: windows decided, INT4 drafts in them, "
                              "drafts that stood (acceptance = kept / drafts)", ["what"], registry=r)

    def watch_pools(self, stats: Callable[[], dict[str, float]], pools: dict[str, str]) -> None:
        """Gauges read at scrape time from the engine's stats; `pools` maps pool kind -> name."""
        r = self.registry
        depth = Gauge("qladder_queue_depth", "Requests waiting for a pool", ["pool"], registry=r)
        busy = Gauge("qladder_slots_in_use", "Sequences decoding (INT4 slots, standby sessions)", ["pool"], registry=r)
        live = Gauge("qladder_requests_in_flight", "Requests admitted and not finished", registry=r)

        def read(key: str) -> Callable[[], float]:
            return lambda: float(stats().get(key, 0))

        depth.labels(pools["int4"]).set_function(read("queue_depth"))
        busy.labels(pools["int4"]).set_function(read("slots_in_use"))
        if "standby" in pools:
            depth.labels(pools["standby"]).set_function(read("standby_depth"))
            busy.labels(pools["standby"]).set_function(read("standby_active"))
        live.set_function(read("live"))
        if "prompt_hits" in stats():
            cache = Gauge("qladder_prompt_cache", "The INT4 pool's prompt cache: prompts restored (hits) and "
                          "prefilled (misses) since start, states kept (entries) and their bytes", ["pool", "what"],
                          registry=r)
            for what in ("hits", "misses", "entries", "bytes"):
                cache.labels(pools["int4"], what).set_function(read(f"prompt_{what}"))
        endpoints = Gauge("qladder_endpoints", "A pool of replicas' endpoints, by health", ["pool", "health"],
                          registry=r)
        moves = Gauge("qladder_endpoint_events", "A pool of replicas: streams continued on a sibling after their "
                      "endpoint failed (migrations), endpoints ejected (heard: of those, on a peer gateway's word), "
                      "endpoints that rejoined", ["pool", "what"],
                      registry=r)
        for kind, name in pools.items():
            if f"{kind}_endpoints" in stats():
                endpoints.labels(name, "healthy").set_function(read(f"{kind}_endpoints_healthy"))
                endpoints.labels(name, "all").set_function(read(f"{kind}_endpoints"))
                for what in ("migrations", "ejections", "heard", "rejoins"):
                    moves.labels(name, what).set_function(read(f"{kind}_{what}"))

    def watch_detector(self, stats: Callable[[], dict[str, float]], endpoints: Sequence[str]) -> None:
        """The audit's test per INT4 endpoint, read at scrape time: its state (0 watched, 1 suspect,
        2 ejected, 3 probing) and CUSUM statistic (a share of its bound)."""
        state = Gauge("qladder_endpoint_state", "The audit's test on an INT4 endpoint: 0 watched, 1 suspect "
                      "(every answer audited), 2 ejected (full precision serves its requests), 3 probing",
                      ["endpoint"], registry=self.registry)
        statistic = Gauge("qladder_endpoint_statistic", "The audit's CUSUM on an INT4 endpoint, the nearer of "
                          "its greedy and sampled tests to its bound, as a share of it (1 ejects)",
                          ["endpoint"], registry=self.registry)

        def read(key: str) -> Callable[[], float]:
            return lambda: float(stats().get(key, 0.0))

        for e in endpoints:
            state.labels(e).set_function(read(f"detector_{e}_state"))
            statistic.labels(e).set_function(read(f"detector_{e}_statistic"))

    def on_alarm(self, a: Alarm) -> None:
        """An endpoint ejected or returned (the standby's thread)."""
        self.endpoint_alarms.labels(a.endpoint, "returned" if a.returned else "ejected").inc()

    def watch_breakers(self, breakers: dict[str, Breaker]) -> None:
        for name, b in breakers.items():
            self.breaker_state.labels(name).set_function(partial(_mode_value, b))

    def on_breaker_change(self, pool: str, _old: BreakerMode, new: BreakerMode) -> None:
        self.breaker_transitions.labels(pool, str(new)).inc()

    def watch_state(self, sync: StateSync) -> None:
        self.state_shared.set(float(sync.shared))
        syncs = Gauge("qladder_state_syncs", "State syncs with the shared store, by result", ["result"],
                      registry=self.registry)
        syncs.labels("ok").set_function(lambda: float(sync.syncs))
        syncs.labels("failed").set_function(lambda: float(sync.failures))

    def watch_quarantine(self, q: Quarantine) -> None:
        Gauge("qladder_quarantine_size", "Prompt fingerprints in quarantine", registry=self.registry
              ).set_function(lambda: float(len(q)))

    def observe(self, ev: Event) -> None:
        """Every engine event (on the engine's threads)."""
        if isinstance(ev, TokenEvent):
            return  # tokens are counted once, from the final result (the text a client got)
        if isinstance(ev, HazardEvent):
            self.hazards.labels(ev.hazard.check, ev.hazard.rung).inc()
        elif isinstance(ev, HandoffEvent):
            h = ev.handoff
            self.handoffs.labels(h.from_rung, h.to_rung).inc()
            self.handoff_latency.observe(h.latency_ms / 1e3)
        elif isinstance(ev, FinalEvent):
            res = ev.result
            for rung in set(res.token_rungs):
                self.tokens.labels(rung).inc(res.token_rungs.count(rung))
            if "ttft_ms" in res.timings:
                self.ttft.observe(res.timings["ttft_ms"] / 1e3)
            if "first_text_ms" in res.timings:
                self.first_text.observe(res.timings["first_text_ms"] / 1e3)
            for ms in res.step_ms:
                self.per_token.observe(ms / 1e3)
            self.finishes.labels(str(res.finish_reason)).inc()
            for what in ("windows", "drafts", "kept"):
                if f"verify_{what}" in res.timings:
                    self.verify.labels(what).inc(res.timings[f"verify_{what}"])

    def observe_audit(self, a: AuditRecord) -> None:
        """A drift audit's record (the standby's thread)."""
        self.audit_agreement.labels(a.prompt_class, a.pool, a.source).observe(a.agreement)
        if math.isfinite(a.kl_top5):  # (an answer audited for in-band suspicion has no INT4 top-5 kept)
            self.audit_kl.labels(a.prompt_class, a.pool, a.source).observe(a.kl_top5)
        if a.excess is not None:
            self.audit_excess.labels(a.prompt_class, a.pool, a.source).observe(a.excess)
        self.audit_diverged.labels(a.prompt_class, a.pool, a.source, str(a.first_divergence is not None).lower()).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
