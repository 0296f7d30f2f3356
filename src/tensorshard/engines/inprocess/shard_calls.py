"""What the fast decoding path asks of a model integration: how one call of a split model becomes each shard's call,
and each shard's output the caller's.

The in-process fast path (compiled_steps.py, stitched_decode.py) runs every shard's compiled forward itself, per
token, outside the engine's own call. Three things there depend on the kind of model, not on the engine:

- the call's arguments by name (`keywords`): a stitched step finds its graph's inputs by argument name, so only a
  call whose arguments are named is stitched; a transformers model names its positional arguments as its forward
  does and turns every cache into one per device there (integrations/transformers/model.py `split_call`);
- each argument as one shard's own (`own`): the engine gives each shard its own copy of some objects (a KV cache
  holds that device's heads only), and a compiled shard is handed that copy, a plain transformers cache, not the
  dispatcher over every device's (integrations/transformers/cache.py);
- a shard's output as the caller sees it (`back`): the shard returns its own cache, the caller gets the
  dispatcher it passed in.

`ShardCalls` itself is the answer for a model without such objects: arguments kept as given (never stitched),
every argument and output passed through as it is. An integration subclasses it once
(integrations/transformers/fast_decode.py `TransformersCalls`) and hands one instance to `CompiledSteps`.

`own` runs for every argument of every shard on every token, `back` once per shard (once per call on the
parallel step's threads), `keywords` once per call: keep them cheap, with no state of their own per call.
"""

from __future__ import annotations

from typing import Any


class ShardCalls:
    """How a call of a split model becomes each shard's call, and a shard's output the caller's (see the module doc).
    The default keeps the call as given: positional arguments stay positional, every shard is given the arguments
    the engine copied to its device, and its output goes back unchanged."""

    def keywords(self, args: tuple, kwargs: dict) -> dict | None:
        """The call's arguments as keyword arguments, each in the form every shard takes (a cache turned into one
        per device), or None where they cannot be named here: the call then runs with `args` and `kwargs` as they
        are, on one compiled graph per shard (a stitched step finds its inputs by argument name)."""
        return None

    def own(self, value: Any, rank: int) -> Any:
        """Argument `value` (one of the call's arguments, as copied to shard `rank`'s device) as shard `rank` should
        be given it: its own copy of an object the engine keeps one per device of, else `value` itself."""
        return value

    def back(self, out: Any, kwargs: dict) -> Any:
        """A shard's output, given the call's keyword arguments `kwargs` (as `keywords` made them), as the caller
        should see it: any per-device object the shard returns (its own cache) replaced by the one the call was
        given."""
        return out
