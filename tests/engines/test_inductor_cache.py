"""engines/inductor_cache.py: what inductor's FX-graph cache did during a compile, in the words of the compile logs."""

import torch

from tensorshard.engines.inductor_cache import CacheUse


def test_the_counts_since_are_said_in_words():
    counters = torch._dynamo.utils.counters["inductor"]
    use = CacheUse()
    assert use.since() == "inductor's cache: nothing looked up"  # (caches off, or nothing compiled)
    counters["fxgraph_cache_hit"] += 2
    assert use.since() == "inductor's cache, 2 graphs: 2 found"
    counters["fxgraph_cache_miss"] += 1
    assert use.since() == "inductor's cache, 3 graphs: 2 found, 1 compiled anew"
    later = CacheUse()
    counters["fxgraph_cache_bypass"] += 1
    said = later.since()
    assert said.startswith("inductor's cache, 1 graph: 1 compiled without the cache") and "says why" in said

