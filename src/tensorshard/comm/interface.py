"""The collectives a parallel style may ask for, as one small interface that every engine implements.

Styles never talk to devices or process groups: they call these methods on the `Comm` of the shard they
run in. The in-process engine implements them between threads, the torchrun engine on
`torch.distributed`. All of them follow the SPMD convention of Megatron-LM: a *replicated* activation has
the same value on every shard and, in the backward pass, the same (full) gradient; a *split* activation
holds this shard's slice, and its gradient is the gradient of that slice.

    all_reduce        partial sums -> replicated       forward: sum            backward: identity
    copy_to_parallel  replicated -> read by split ops  forward: identity       backward: sum
    all_gather        split -> replicated              forward: concatenate    backward: take own slice
    split             replicated -> split              forward: take own slice backward: concatenate
    tie               a parameter held by several shards, each seeing part of its gradient:
                                                       forward: identity       backward: sum over holders
    partial_grads     parameters whole on every shard that see part of the computation (a LoRA factor beside
                      a split layer, a norm on sequence shards): their gradients are partial sums, summed
                      once per backward pass for all of them (bucketed)

`copy_to_parallel` is the one collective of the backward pass: a column-parallel layer reading a
replicated input. Engines apply it once per input tensor per forward call, so q, k and v reading the same
normed hidden states cost one all-reduce in backward, not three.

Optional collectives, for sequence parallelism and vocabulary-parallel losses; an engine that lacks them
raises NotImplementedError naming the feature (today only the torchrun engine has them):

    reduce_scatter    partial sums -> sequence shards  forward: reduce-scatter  backward: all-gather
    gather_sequence   sequence shards -> whole, read by column layers
                                                       forward: all-gather      backward: reduce-scatter
    as_sharded        a split activation handed to user code as one object that knows its split (DTensor)

Each engine implements these on top of its *raw* collectives (`Collectives`, below: no autograd, counted once);
the autograd nodes that give each collective its backward are written once, over those, in comm/functions.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch

from ..partition import Partition


class Collectives(ABC):
    """The raw collectives under one autograd node of comm/functions.py: no autograd, each reported once to
    comm/counter.py.

    A node holds the tensors of `ranks`: one shard's (a process of the torchrun engine, an in-process shard that
    owns its graph: the other shards meet it inside the call) or every shard's at once (in-process shards sharing
    one accelerator, whose backward runs as one graph spanning them). Each method takes one tensor per rank of
    `ranks`, in that order, and returns each rank's result, a tensor of its own. `op` names the collective being
    run ("copy_to_parallel", "split", ...) for rendezvous checks and errors; `phase` is "forward" or "backward".
    """

    ranks: Sequence[int]
    world_size: int

    @abstractmethod
    def reduce(self, xs: Sequence[torch.Tensor], *, op: str, where: str, phase: str) -> list[torch.Tensor]:
        """The sum over every shard."""

    @abstractmethod
    def gather(self, xs: Sequence[torch.Tensor], dim: int, partition: Partition, *, op: str, where: str,
               phase: str) -> list[torch.Tensor]:
        """The whole tensor along `dim`, each shard bringing its slice (`partition`)."""

    @abstractmethod
    def reduce_holders(self, xs: Sequence[torch.Tensor], groups: list[list[int]], *, where: str) -> list[torch.Tensor]:
        """The gradient of a parameter held by several shards: each group of `groups` (ranks) summed over its
        members; a rank in no group keeps its own (the backward pass of `tie`)."""

    def gather_into_one(self, xs: Sequence[torch.Tensor], dim: int, partition: Partition, *, where: str) -> list[torch.Tensor]:
        """`gather` into ONE whole that every shard shares (each gets a view of it): a result no shard changes
        afterwards, such as a model's logits (in-process shards that own their graphs; the caller checks)."""
        raise NotImplementedError(f"{where}: one shared whole needs shards in one process, each owning its graph")

    def reduce_lists(self, per_rank: Sequence[list[torch.Tensor | None]], *, where: str) -> list[list[torch.Tensor | None]]:
        """Each rank's list of tensors (None where it has none), every position summed over the shards: the
        partial gradients of `partial_grads`, all in one collective (the in-process engine's; the torchrun
        engine buckets them instead, comm/grad_bucket.py)."""
        raise NotImplementedError(f"{where}: these collectives sum partial gradients in their own bucket")

    def gather_rows(self, per_rank: Sequence[list[torch.Tensor]], partitions: Sequence[Partition], *,
                    where: str) -> list[torch.Tensor]:
        """Each rank's list of slices (rows of `partitions`, along dim 0) gathered, in one collective: the whole
        tensors, rank-major (the in-process engine's ZeRO-3; under torchrun FSDP2 does this job)."""
        raise NotImplementedError(f"{where}: these collectives gather parameters with FSDP2, not here")

    def reduce_scatter_even(self, xs: Sequence[torch.Tensor], dim: int, *, where: str, phase: str) -> list[torch.Tensor]:
        """(.., T, ..) partial sums on each shard -> this shard's (.., T/N, ..) slice of the total."""
        raise _torchrun_only("sequence parallelism (reduce-scatter to sequence shards)", where)

    def gather_even(self, xs: Sequence[torch.Tensor], dim: int, *, where: str, phase: str) -> list[torch.Tensor]:
        """(.., T/N, ..) on each shard -> (.., T, ..), in rank order."""
        raise _torchrun_only("sequence parallelism (all-gather of sequence shards)", where)


class Comm(ABC):
    """Collectives for one shard (rank) of a tensor-parallel group."""

    rank: int
    world_size: int

    @abstractmethod
    def all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor: ...

    def compiling_all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        """`all_reduce` for a caller that knows dynamo is tracing a call without gradients (a style's no-gradient
        forward, styles/style.py `wrap_forward`): a comm may give that branch alone, in fewer lines to trace."""
        return self.all_reduce(x, where=where)

    @abstractmethod
    def copy_to_parallel(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor: ...

    @abstractmethod
    def all_gather(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor: ...

    @abstractmethod
    def split(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor: ...

    @abstractmethod
    def tie(self, x: torch.Tensor, groups: list[list[int]], *, where: str = "") -> torch.Tensor: ...

    @abstractmethod
    def partial_grads(self, module, names, *, where: str = "") -> None: ...

    # -- optional: sequence parallelism and loss parallelism ---------------------------------------------

    def reduce_scatter(self, x: torch.Tensor, dim: int, *, where: str = "") -> torch.Tensor:
        raise _torchrun_only("sequence parallelism (reduce-scatter to sequence shards)", where)

    def gather_sequence(self, x: torch.Tensor, dim: int, *, where: str = "") -> torch.Tensor:
        raise _torchrun_only("sequence parallelism (all-gather of sequence shards)", where)


    def as_sharded(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = ""):
        raise _torchrun_only("loss parallelism (vocabulary-sharded logits)", where)


def _torchrun_only(feature: str, where: str) -> NotImplementedError:
    return NotImplementedError(
        f"{where or 'this module'}: {feature} needs the torchrun engine (tensorshard.parallelize under torchrun); "
        "the in-process engine does not support it. Use a plan without SequenceParallel / VocabParallelHead here."
    )


class NoComm(Comm):
    """The communicator of a module that is not running inside an engine: every call is an error."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def _fail(self, where: str):
        raise RuntimeError(
            f"{where or 'this module'} is one shard of a tensor-parallel model and cannot run on its own. "
            "Call the model returned by tensorshard.tensor_parallel() (or tensorshard.parallelize())."
        )

    def all_reduce(self, x, *, where=""):
        self._fail(where)

    def copy_to_parallel(self, x, *, where=""):
        self._fail(where)

    def all_gather(self, x, dim, partition, *, where=""):
        self._fail(where)

    def split(self, x, dim, partition, *, where=""):
        self._fail(where)

    def tie(self, x, groups, *, where=""):
        self._fail(where)

    def partial_grads(self, module, names, *, where=""):
        self._fail(where)
