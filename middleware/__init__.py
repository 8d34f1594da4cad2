"""kvgate core: ASGI app, config, plugin framework, scheduler, proxying, errors.

Never imports ``plugins`` or ``engines`` by name: they are found through the registry.
"""
