"""Summaries, markdown table and plot of the replay benchmark."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.replay_client import Outcome
from bench.replay_metrics import Reference, hit_ratio, imbalance, percentile


@dataclass(frozen=True, slots=True)
class Summary:
    """One system's figures on one trace. TTFT in H100-equivalent seconds (wall / time scale)."""

    system: str
    requests: int
    ok: int
    failed: int
    hit_ratio: float | None  # from the engines' reported cached tokens (usage)
    engine_hit_ratio: float | None  # from the engines' /metrics counters
    imbalance: float | None  # max / mean of uncached prefill tokens per engine
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    late_p99_s: float | None  # how late requests were sent (client saturation), wall seconds
    preemptions: int
    uncached_per_engine: dict[str, float]
    gateway_counters: dict[str, float]


def summarize(
    system: str, outcomes: Sequence[Outcome], counters: Mapping[str, Mapping[str, float]],
    time_scale: float, prompt_lengths: Sequence[int],
) -> Summary:
    """Figures of one run; ``counters`` per engine (plus ``gateway``: kvgate's KV-event
    counters, kept as they are); ``prompt_lengths`` are the trace's input lengths (failed
    requests count as misses, so a router cannot gain hit ratio by failing requests)."""
    gateway = dict(counters.get("gateway", {}))
    counters = {k: v for k, v in counters.items() if k != "gateway"}
    ok = [o for o in outcomes if o.ok]
    scale = 1.0 / time_scale if time_scale > 0 else 1.0
    ttfts = [o.ttft_s * scale for o in ok if o.ttft_s is not None]
    cached = [o.cached_tokens if o.ok else 0 for o in outcomes]
    uncached = {name: c["vllm:prompt_tokens_total"] - c["vllm:prompt_tokens_cached_total"]
                for name, c in counters.items()}
    prompt_total = sum(c["vllm:prompt_tokens_total"] for c in counters.values())
    cached_total = sum(c["vllm:prompt_tokens_cached_total"] for c in counters.values())
    return Summary(
        system=system, requests=len(outcomes), ok=len(ok), failed=len(outcomes) - len(ok),
        hit_ratio=hit_ratio(cached, prompt_lengths),
        engine_hit_ratio=cached_total / prompt_total if prompt_total else None,
        imbalance=imbalance(uncached),
        ttft_p50=percentile(ttfts, 50), ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        late_p99_s=percentile([o.late_s for o in outcomes], 99),
        preemptions=int(sum(c["vllm:num_preemptions_total"] for c in counters.values())),
        uncached_per_engine=uncached, gateway_counters=gateway,
    )


def _fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(trace: str, ref: Reference, engine_ref: Reference, rows: Sequence[Summary]) -> str:
    """A markdown table of one trace's results."""
    lines = [
        f"**{trace}** — ideal {ref.ideal:.3f}, pooled LRU ({ref.capacity_blocks:,} blocks) "
        f"{ref.pooled_lru:.3f} (README accounting); engine-reachable: ideal "
        f"{engine_ref.ideal:.3f}, pooled LRU {engine_ref.pooled_lru:.3f}",
        "",
        "| system | hit ratio | imbalance (max/mean) | TTFT p50 / p90 / p99 (s) | failed | "
        "preemptions |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.system} | {_fmt(r.hit_ratio)} | {_fmt(r.imbalance, 2)} | "
            f"{_fmt(r.ttft_p50, 2)} / {_fmt(r.ttft_p90, 2)} / {_fmt(r.ttft_p99, 2)} | "
            f"{r.failed} | {r.preemptions} |"
        )
    return "\n".join(lines)


def plot(path: Path, results: Mapping[str, Any]) -> None:
    """Bar charts per trace: hit ratio (with ideal and pooled-LRU lines), imbalance, TTFT p50."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(results)
    fig, axes = plt.subplots(len(traces), 3, figsize=(16, 4.5 * len(traces)), squeeze=False)
    for row, trace in enumerate(traces):
        data = results[trace]
        rows: list[dict[str, Any]] = data["systems"]
        names = [r["system"] for r in rows]
        _bars(axes[row][0], names, [r["hit_ratio"] for r in rows], f"{trace}: prefix hit ratio")
        ref = data["reference"]
        axes[row][0].axhline(ref["pooled_lru"], color="red", ls="--", label="pooled LRU")
        axes[row][0].axhline(ref["ideal"], color="green", ls=":", label="ideal")
        axes[row][0].legend(fontsize=8)
        _bars(axes[row][1], names, [r["imbalance"] for r in rows], "prefill imbalance (max/mean)")
        axes[row][1].axhline(1.10, color="red", ls="--")
        _bars(axes[row][2], names, [r["ttft_p50"] for r in rows], "TTFT p50 (H100 s)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _bars(ax: Any, names: list[str], values: list[float | None], title: str) -> None:
    ax.bar(range(len(names)), [v or 0.0 for v in values], color="tab:blue")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=7)
    ax.set_title(title, fontsize=10)
