"""Engines: how split shards run (in one process over threads, or under torchrun), and what they share."""
