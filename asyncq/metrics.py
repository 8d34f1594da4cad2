"""The async queue's Prometheus metrics (one collector for the plugin's ``MetricsSource``).

Bounded: labels are the job kinds (3), the outcomes (terminal states, 4), the gate reasons (6).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvgate.asyncq.api import JobState

#: Wait buckets (seconds from submit to start): queued work waits seconds to a day.
WAIT_BUCKETS = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)


class QueueMetrics(Collector):
    def __init__(self) -> None:
        self.started = Counter("kvgate_async_jobs_started", "Job runs started (attempts)",
                               ["kind"], registry=None)
        self.finished = Counter("kvgate_async_jobs_finished", "Jobs that reached a terminal "
                                "state, by outcome", ["kind", "outcome"], registry=None)
        self.retries = Counter("kvgate_async_job_retries", "Job runs that failed with a 5xx "
                               "or connection error and were queued again", ["kind"],
                               registry=None)
        self.reclaimed = Counter("kvgate_async_leases_reclaimed", "Running jobs whose lease "
                                 "lapsed (their replica died) put back in the queue",
                                 registry=None)
        self.wait = Histogram("kvgate_async_job_wait_seconds", "Submit to first start",
                              ["kind"], buckets=WAIT_BUCKETS, registry=None)
        self.gate_closed = Counter("kvgate_async_gate_closed", "Runner polls that found no "
                                   "headroom, by reason", ["reason"], registry=None)
        self.outages = Counter("kvgate_async_store_outages", "Job store outages (pulling "
                               "paused, submits refused with 503)", registry=None)
        #: Unfinished jobs by (kind, state), refreshed by the runner (no I/O on scrape).
        self.counts: Mapping[tuple[str, JobState], int] = {}
        self.running_here = 0
        self.gate_open = False
        self.store_up = True

    def collect(self) -> Iterator[Metric]:
        for m in (self.started, self.finished, self.retries, self.reclaimed, self.wait,
                  self.gate_closed, self.outages):
            yield from m.collect()
        jobs = GaugeMetricFamily("kvgate_async_jobs", "Unfinished jobs in the store by kind "
                                 "and state (all replicas)", labels=["kind", "state"])
        for (kind, state), n in sorted(self.counts.items()):
            jobs.add_metric([kind, str(state)], n)
        yield jobs
        yield GaugeMetricFamily("kvgate_async_jobs_running_here", "Jobs this replica runs now",
                                value=self.running_here)
        yield GaugeMetricFamily("kvgate_async_headroom_open", "1 while the headroom gate lets "
                                "jobs start", value=int(self.gate_open))
        yield GaugeMetricFamily("kvgate_async_store_up", "1 while the job store answers",
                                value=int(self.store_up))


__all__ = ["WAIT_BUCKETS", "QueueMetrics"]
