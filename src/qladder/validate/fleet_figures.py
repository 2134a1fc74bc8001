"""The figures of `qladder bench fleet`, from its outcomes and observations (called by
`recompute.figures`; benchmarks/fleet.py says what each phase does).

    compare      tok/s per window (its answers' tokens over its span); the fleet's pooled over
                 direct's pooled, with its bootstrap interval over the interleaved rounds
                 (`ratios.fleet_over_direct_tok_s`, at least MIN_WINDOWS windows a side to decide);
                 latency P50/P99 per side (a failed request counts as the slowest)
    kill         the answers in flight at the kill (sent before it, done after): 5xx, garbage;
                 those whose stream went on at the sibling (each answer's own `migrations`, from
                 its extension: at least one must have, or the phase proved nothing), and how many
                 of these equal their prompt's answer in the compare phase (the unbroken greedy
                 answer; a prompt whose compare answers differ among themselves is counted apart);
                 hazards and handoffs in the phase (a replica's death is not the model's: none);
                 the observed migrations, time to eject and to rejoin
    redis        5xx while Redis was down and back; both gateways seen on their local view, and
                 shared again after the restart
    burst        the peer's breaker open after A's (`breaker_seen_by_peer_s`); the prompt A
                 quarantined, routed at B
    incidents    PostgreSQL's rows against the hazards both gateways' /metrics counted
    http_5xx, garbage   over every request of the run but the warm-up (garbage: qladder's answers)
The targets (issue 19) are fixed in TARGETS before any run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qladder.percentiles import percentile
from qladder.validate.calibration import rejudge
from qladder.validate.figure_parts import overall, throughput_verdict, window_rate
from qladder.validate.figure_parts import verdict_of as _v
from qladder.validate.outcome import Outcome

TARGETS = {"fleet_over_direct_tok_s": 0.9, "time_to_eject_s": 2.0, "time_to_rejoin_s": 5.0,
           "breaker_seen_by_peer_s": 1.0}


def _tok_s(outs: Sequence[Outcome]) -> float | None:
    """A window's tokens over its span (figure_parts.window_rate)."""
    rate: float | None = window_rate(outs)["tok_s"]
    return rate


def _latency(outs: Sequence[Outcome], slowest: float) -> dict[str, Any]:
    lat = [o.latency_ms if o.ok else slowest for o in outs]
    return {"requests": len(outs), "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)}


def fleet_figures(outcomes: Sequence[Outcome], observations: dict[str, Any]) -> dict[str, Any]:
    cal = rejudge(outcomes)
    outs = [o for o in outcomes if o.phase != "warmup"]
    slowest = max((o.latency_ms for o in outs), default=0.0)
    f: dict[str, Any] = {"mode": "bench-fleet", "targets": dict(TARGETS)}
    cmp_ = [o for o in outs if o.phase == "compare"]
    fleet = [o for o in cmp_ if o.config.startswith("fleet")]
    direct = [o for o in cmp_ if o.config == "llama_server_direct"]
    rounds = sorted({o.round for o in cmp_})
    per_round = {r: (_tok_s([o for o in fleet if o.round == r]), _tok_s([o for o in direct if o.round == r]))
                 for r in rounds}
    f["compare"] = {"windows": {str(r): {"fleet_tok_s": a, "direct_tok_s": b} for r, (a, b) in per_round.items()},
                    "latency": {"fleet": _latency(fleet, slowest), "direct": _latency(direct, slowest)}}
    # (the fleet's two gateways share a round's window, `compare/fleet/r<round>`: their requests together)
    tv, iv = throughput_verdict("compare: fleet tok/s over direct (pooled over interleaved windows)", fleet,
                                direct, TARGETS["fleet_over_direct_tok_s"])
    f["ratios"] = {"fleet_over_direct_tok_s": iv.to_dict()}
    # the unbroken answers: each prompt's compare-phase answers through the fleet
    answers: dict[str, set[tuple[int, ...]]] = {}
    for o in fleet:
        if o.ok:
            answers.setdefault(o.prompt_id, set()).add(tuple(o.token_ids))
    kill_obs = observations.get("kill", {})
    kill_at = kill_obs.get("kill_clock_s")
    killed = [o for o in outs if o.phase == "kill"]
    flight = [o for o in killed if kill_at is not None and o.start_s is not None and o.end_s is not None
              and o.start_s < kill_at < o.end_s]
    reported = any(o.migrations is not None for o in flight)  # (runs before 727cccd did not record it)
    moved = [o for o in flight if o.migrations] if reported else flight
    stable = [o for o in moved if len(answers.get(o.prompt_id, ())) == 1]
    same = sum(1 for o in stable if (tuple(o.token_ids),) == tuple(answers[o.prompt_id]))
    f["kill"] = {"requests": len(killed), "in_flight_at_kill": len(flight), "migrated_answers": len(moved),
                 "five_xx": sum(o.five_xx for o in killed), "garbage": sum(o.garbage for o in killed),
                 "migrated_with_a_stable_reference": len(stable), "identical_to_unbroken": same,
                 "identical_share": same / len(stable) if stable else None,
                 "hazards": sum(len(o.hazards) for o in killed), "handed_off": sum(bool(o.handoff_ms) for o in killed),
                 **{k: kill_obs.get(k) for k in ("migrations", "time_to_eject_s", "time_to_rejoin_s")}}
    red = [o for o in outs if o.phase == "redis"]
    r_obs = observations.get("redis", {})
    f["redis"] = {"requests": len(red), "five_xx": sum(o.five_xx for o in red), "garbage": sum(o.garbage for o in red),
                  "local_view_seen": r_obs.get("local_view_seen"), "rejoined_after_s": r_obs.get("rejoined_after_s")}
    b_obs = observations.get("burst", {})
    routes = b_obs.get("quarantined_prompt_routes", {})
    f["burst"] = {"requests": sum(o.phase == "burst" for o in outs),
                  "five_xx": sum(o.five_xx for o in outs if o.phase == "burst"),
                  "breaker_seen_by_peer_s": b_obs.get("breaker_seen_by_peer_s"),
                  "quarantine_seen_by_peer": routes.get("b") == "quarantine", "routes": routes}
    inc = observations.get("incidents", {})
    f["incidents"] = {"postgres_rows": inc.get("postgres_rows"), "metrics_hazards": inc.get("metrics_hazards_total")}
    ours = [o for o in outs if o.config.startswith("fleet")]
    f["http_5xx"] = sum(o.five_xx for o in outs)
    f["garbage"] = sum(o.garbage for o in ours)
    f["garbage_direct"] = sum(o.garbage for o in direct)  # llama-server's own answers, for reading
    t, k = TARGETS, f["kill"]
    v = [tv,
         _v("kill: 5xx", k["five_xx"] if killed else None, 0, lambda x: x == 0),
         _v("kill: garbage", k["garbage"] if killed else None, 0, lambda x: x == 0),
         _v("kill: answers in flight that went on at the sibling", len(moved) if killed and reported else None, 1,
            lambda x: x >= 1, f"{len(moved)} of {len(flight)} in flight at the kill"),
         _v("kill: migrated answers identical to their unbroken answer (share)", k["identical_share"], 1.0,
            lambda x: x == 1.0, f"{same} of {len(stable)} ({len(moved) - len(stable)} migrated had no stable "
            "reference)"),
         _v("kill: hazards and handoffs (a replica's death is not the model's)",
            k["hazards"] + k["handed_off"] if killed else None, 0, lambda x: x == 0),
         _v("kill: time to eject, both gateways (s)", k["time_to_eject_s"], t["time_to_eject_s"],
            lambda x: x <= t["time_to_eject_s"]),
         _v("kill: time to rejoin after the restart, both gateways (s)", k["time_to_rejoin_s"], t["time_to_rejoin_s"],
            lambda x: x <= t["time_to_rejoin_s"]),
         _v("burst: the peer's breaker open after A's (s)", f["burst"]["breaker_seen_by_peer_s"],
            t["breaker_seen_by_peer_s"], lambda x: x <= t["breaker_seen_by_peer_s"]),
         _v("burst: a prompt A quarantined starts on the standby at B", float(f["burst"]["quarantine_seen_by_peer"])
            if routes else None, 1.0, lambda x: x == 1.0, str(routes)),
         _v("redis: 5xx while it was down and back", f["redis"]["five_xx"] if red else None, 0, lambda x: x == 0),
         _v("redis: both gateways on their local view, then shared again",
            None if not r_obs else float(bool(r_obs.get("local_view_seen")) and r_obs.get("rejoined_after_s")
                                         is not None), 1.0, lambda x: x == 1.0),
         _v("incidents: PostgreSQL rows minus the hazards both /metrics counted", None if not inc else
            inc["postgres_rows"] - inc["metrics_hazards_total"], 0, lambda x: x == 0),
         _v("http 5xx over the run", f["http_5xx"] if outs else None, 0, lambda x: x == 0),
         _v("garbage over the run (qladder's answers)", f["garbage"] if ours else None, 0, lambda x: x == 0)]
    f["calibration"] = cal.to_dict()
    f["verdicts"] = v
    f["verdict"] = overall(v)
    return f
