"""Integrations with other libraries (transformers, ...), each importing its library only when used."""
