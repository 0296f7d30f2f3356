"""The README's multi-node torchrun command, as 2 "nodes" x 2 processes on loopback."""

import os
import subprocess
import sys

import pytest

from support.harness import child_env, free_port

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

HERE = os.path.dirname(__file__)


def test_two_nodes_of_two_processes(tmp_path):
    env = child_env(OMP_NUM_THREADS="1")
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", f"--node_rank={rank}",
             "--master_addr=127.0.0.1", f"--master_port={port}", os.path.join(HERE, "scripts", "two_d_train.py")],
            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=120)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert "2 nodes x 2 ranks: losses match one process" in outputs[0]
    assert "losses match" not in outputs[1]  # printed by global rank 0 only
