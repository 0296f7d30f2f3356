"""What a profile shows for each target we may miss, and what would close the gap: written by hand from the
investigation behind BENCHMARKS.md (profiles with torch.profiler and CPU-time accounting on the 2-core
machine), keyed by the target's key in targets.py. render.py prints an entry only when its target is
missed in the run being rendered, under the measured numbers and the run's own profile table."""

_SHARED_CORES = (
    "On a shared 2-core machine the first thing to check is the load average in the header and the \"CPU work\" "
    "column of the speed tables: CPU work counts the CPU seconds of all devices together, which other processes "
    "do not inflate much, while the wall time of 2 simulated devices needs 2 idle cores. When another process "
    "keeps one core busy, two shards share the other one and a 2-device run cannot beat the 1-device run."
)

ANALYSIS: dict[str, str] = {
    "torchrun-train": (
        "Where the time goes (rank 0's profile above, and the CPU work column): the matrix products halve, but "
        "each rank also repeats everything the plan leaves whole, and pays for the collectives on the cores that "
        "compute. Per step at 6 layers: 13 all-reduces forward and 13 backward of a (4, 128, 1024) activation "
        "(2 MiB each; through shared memory between the ranks of one host, no overlap with compute), the RMSNorms, residual adds and the "
        "embedding masking on every rank. The language-model loss is no longer among them: with `labels=` it is "
        "computed from each rank's vocabulary slice of the logits (2 all-reduces of per-token numbers, nothing "
        "in backward) and the 32 MiB logits are gathered only if read. Every collective is also a "
        "synchronisation point, so when one rank is descheduled the other waits. What would close the rest: "
        "asynchronous backward all-reduces overlapped with the next layer's gradient computation, and sequence "
        "parallelism for the norms. " + _SHARED_CORES
    ),
    "inprocess-train": (
        "Where the time goes: the forward and backward passes of the shards run concurrently, one thread each "
        "(each shard owns its autograd graph), and so does a plain AdamW step (each shard's parameters in its "
        "thread, by default). At every large collective each shard sums one chunk of the elements into every "
        "shard's result, so no shard waits while another computes for all; the loss comes from each shard's "
        "vocabulary slice and the logits are assembled once, all shards writing their slices at once. What "
        "stays replicated: the RMSNorms and residual adds, and ZeRO-3's gather of the norm weights. "
        + _SHARED_CORES
    ),
    "inprocess-forward": (
        "Where the time goes: the shards' matrix products run concurrently (their threads release the GIL "
        "inside the kernels), at each collective every shard sums one chunk of the elements (2 MiB per all-reduce "
        "at this batch) into every shard's result, in its own thread, and the 32 MiB of logits are assembled once at the end "
        "of the call, each shard copying its slice (before, each shard built its own copy and all but one were "
        "dropped). What remains beyond half the 1-device time: work every shard repeats (the RMSNorms, residual "
        "adds and the all-reduces' sums, about 10 ms per shard), the matrix products of two cores sharing one "
        "memory bus and cache, and the Python of every layer running in both shards, taking turns on the GIL. "
        + _SHARED_CORES
    ),
    "generate": (
        "Where the time goes: a decode step multiplies a single token's activations with every weight, so it is "
        "bound by memory bandwidth, which the two cores share, and by Python, which every shard runs in full "
        "(section 4 measures it per shard); per token the shards meet 14 times (2 all-reduces per block, the "
        "embedding's all-reduce and the logits' all-gather), each a thread hand-off. The engine runs such calls "
        "with the shards together or one at a time, whichever it measured faster. What would close it: fewer rendezvous per token (fuse the embedding all-reduce into the first "
        "block's, keep the next-token argmax on vocabulary slices), and spinning briefly before sleeping at a "
        "rendezvous when the wait is expected to be short. " + _SHARED_CORES
    ),
    "torchrun-generate": (
        "Where the time goes: per token 14 collectives of a few kilobytes, each a meeting of the two processes "
        "through shared memory (one write and one wake-up per peer: tens of microseconds on idle cores, far more "
        "when a rank is descheduled), on top of the memory-bound decode step. What would close it: the same fewer "
        "collectives per token as for the in-process engine; on GPUs, NCCL's latency is microseconds. "
        + _SHARED_CORES
    ),
    "overhead": (
        "Where the time goes: at 1 device no collective runs. The in-process engine calls its single shard "
        "directly (plus the transformers wrapper's per-call work in generation: the sharded KV cache and the "
        "generate hooks); the torchrun engine keeps DTensor parameters, so every module's forward swaps in "
        "local views and AdamW's per-parameter arithmetic goes through DTensor dispatch (`PythonSubclass` in "
        "the profile). Differences of a few percent at 1 device are within the spread of the unsplit model's "
        "own repetitions on a shared machine (compare its min - max and the drift row). What would close a "
        "real gap: plain tensors instead of DTensors on a 1-device mesh, and a fused (foreach) optimizer step "
        "over the local shards."
    ),
}
