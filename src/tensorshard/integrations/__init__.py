"""Integrations with other libraries (transformers, Lightning); each imports its library only when used."""
