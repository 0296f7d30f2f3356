"""What the tests share: models (models.py, custom_models.py, tiny_llama.py, hf_configs.py), plans (plans.py), numerical
helpers (helpers.py), the process harness (harness.py, spawned.py) and checkpoint tools (checkpoints.py,
tiny_gguf.py)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: src/, docs/, benchmarks/, tests/
