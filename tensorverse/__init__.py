"""Tensorverse: prove in production whether an LLM runtime change breaks an agent."""

__version__ = "0.1.0"
