"""Quota and budget stores of the ``quotas`` plugin (plugins/quotas.py)."""
