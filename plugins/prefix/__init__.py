"""Prefix-cache-aware routing: see README.md in this folder."""

from __future__ import annotations

from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from kvgate.plugins.prefix.producer import PrefixCacheProducer
from kvgate.plugins.prefix.scorer import PrefixCacheScorer
from kvgate.plugins.prefix.tokenizer import Tokenizer

__all__ = [
    "KvEventsSubscriber",
    "PrefixCacheProducer",
    "PrefixCacheScorer",
    "Tokenizer",
]
