"""Relax: fully-asynchronous RL post-training of LLMs on Ray, with an elastic rollout pool."""

__version__ = "0.1.0"
