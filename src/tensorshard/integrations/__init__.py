"""Integrations with training frameworks; each module imports its framework lazily (on import of the module)."""
