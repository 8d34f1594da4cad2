"""A vLLM-compatible simulated engine for tests and benchmarks (see docs/simulator.md).

Public entry points: :class:`engines.sim.config.SimConfig`,
:func:`engines.sim.app.create_sim_app`, :func:`engines.sim.testing.serve_sim`, and the pure
tokenizer in :mod:`engines.sim.tokenizer`.
"""
