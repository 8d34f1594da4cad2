"""kvgate: a cache-aware OpenAI-compatible gateway for self-hosted LLM engines.

One import root for the project's top-level folders (``middleware/``, ``plugins/``, ``engines/``,
``pricing/``, ``apis/``, ``asyncq/``): each is linked here, so it installs and imports as
``kvgate.middleware``, ``kvgate.plugins``, …, and nothing but ``kvgate`` lands at the top of
site-packages (docs/architecture.md, "Layout").
"""
