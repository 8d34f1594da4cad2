"""A vLLM-compatible simulated engine for tests and benchmarks (see docs/simulator.md).

Public entry points: :class:`kvgate.engines.sim.core.config.SimConfig`,
:func:`kvgate.engines.sim.http.server.create_sim_app`, :func:`kvgate.engines.sim.testing.serve_sim`,
and the pure tokenizer in :mod:`kvgate.engines.sim.core.tokenizer`.
"""
