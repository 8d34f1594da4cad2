"""Flow control for live traffic: saturation per engine and pool, a bounded gateway-side queue
with late binding, priority bands, fairness across tenants (VTC) and agent sessions (LAS).
See README.md here and docs/flow-control.md."""
