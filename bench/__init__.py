"""Benchmarks for kvgate: gateway overhead, HTTP-client choice, and their helpers.

Nothing here runs at import time; each benchmark is a ``python -m bench.<name>`` entry point.
"""
