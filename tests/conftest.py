"""Fixtures of the whole suite: a private random generator, and the session's torchrun process pools.

The folders mirror src/tensorshard (core, plans, engines/inprocess, engines/torchrun, inference, checkpoint,
integrations, cli), plus reliability/ and property/ across them; what the tests share (models, plans,
helpers, the process harness) is the `support` package, importable because pyproject's pytest settings put
tests/ on the path. Child processes get the same path from `support.harness.child_env()`.

The pools (support/harness.py) are gloo process groups of 2, 3 or 4 ranks, spawned once, when a test first
asks for one, and shared by every folder: engines/torchrun, checkpoint (3 ranks: uneven splits such as
59/59/58 features) and reliability. Fault tests that end a rank spawn their own.

`make test` runs the files over pytest-xdist's workers (`-n auto --dist loadfile`): a file's tests, and so its
module-scoped fixtures, stay in one worker, and so do the files that share a costly session fixture or run
(SHARED_SCOPES); each worker has its own pools, and the docs run once for all of them (support/docs.py).
"""

import os

import pytest
import torch

from support import deprecations, docs
from support.harness import shared_pool

torch.set_num_threads(1)  # two cores: keep the simulated devices from fighting over threads
# Decode captures are not kept on disk across tests (engines/capture_store.py): a test sees the trace it sets out to
# see, whatever ran before it. tests/integrations/transformers/test_kept_captures.py turns the store on, in a folder
# of its own. (Set here, so torchrun jobs and other child processes inherit it.)
os.environ.setdefault("TENSORSHARD_CAPTURE_CACHE", "0")
# Likewise the shards' first traces run in this process, one after the other, as the tests counting them expect
# (engines/inprocess/forked_traces.py); tests/integrations/transformers/test_forked_traces.py turns the forks on.
os.environ.setdefault("TENSORSHARD_FORKED_TRACE", "0")


# Files kept in one pytest-xdist worker: the session fixture or run they share is made once (path prefix -> scope).
SHARED_SCOPES = {
    "tests/integrations/transformers/test_smollm2": "smollm2",  # the real SmolLM2, loaded once (conftest there)
    # the files reading support.docs.docs_runs(): one worker runs the docs while the other goes on
    **dict.fromkeys(["tests/test_docs_snippets.py", "tests/plans/test_docs_plans.py",
                     "tests/compat/test_migrating_doc.py", "tests/engines/inprocess/test_backward.py",
                     "tests/quant/test_quant_docs.py", "tests/integrations/transformers/test_finetuning_docs.py"], "docs"),
}


def _shared_scope(path: str) -> str:
    """A test file's scope of scheduling: itself, or the scope it shares with others."""
    return next((scope for prefix, scope in SHARED_SCOPES.items() if path.startswith(prefix)), path)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the files of SHARED_SCOPES in one scope each; other modes as pytest-xdist has them."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _shared_scope(super()._split_scope(nodeid))

    return SharedFileScheduling(config, log)


@pytest.fixture(autouse=True)
def _no_deprecated_calls():
    """A deprecated API of torch, transformers or peft called by tensorshard, a doc or an example fails the test
    (support/deprecations.py); pytest's warning capture undoes it after the test."""
    deprecations.install()


@pytest.fixture(scope="session", autouse=True)
def _docs_folder(tmp_path_factory):
    """The docs' runs keep their folders in this session's temporary folder; under pytest-xdist, in the one its
    workers share (each worker's is a folder inside it)."""
    base = tmp_path_factory.getbasetemp()
    docs.FOLDER = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture
def gen() -> torch.Generator:
    """A private generator for test data (shards run in threads; the global seed is shared)."""
    return torch.Generator().manual_seed(1234)


def _pool(world: int):
    pool = shared_pool(world)
    yield pool
    pool.stop()


@pytest.fixture(scope="session")
def pool2():
    yield from _pool(2)


@pytest.fixture(scope="session")
def pool3():
    yield from _pool(3)


@pytest.fixture(scope="session")
def pool4():
    yield from _pool(4)
