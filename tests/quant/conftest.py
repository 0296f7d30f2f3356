import pytest

pytest.importorskip("bitsandbytes")

from support.quantized_models import ALIGNED, FEW_KV_HEADS, UNALIGNED, save_llama  # noqa: E402


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """A tiny random Llama whose splits at 2 and 3 devices keep 4-bit blocks whole."""
    return save_llama(tmp_path_factory.mktemp("llama"), **ALIGNED)


@pytest.fixture(scope="session")
def unaligned_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama_unaligned"), **UNALIGNED)


@pytest.fixture(scope="session")
def few_kv_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama_few_kv"), **FEW_KV_HEADS)
