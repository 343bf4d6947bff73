import pytest
import torch

from symphony.kernel.config import EngineConfig, ModelConfig
from symphony.kernel.weights import random_weights

# Tolerances, stated once (float32 on the CPU):
#   tiny random models: paged logits vs reference, max |diff| <= 1e-4
#   SmolLM2-135M (logits of magnitude ~20): max |diff| <= 2e-3
TINY_ATOL = 1e-4
SMOLLM_ATOL = 2e-3


def tiny_config(**over) -> ModelConfig:
    base = dict(arch="llama", vocab_size=101, hidden_size=64, intermediate_size=96, n_layers=2,
                n_heads=4, n_kv_heads=2, head_dim=16, max_context=256, name="tiny")
    base.update(over)
    return ModelConfig(**base)


@pytest.fixture
def tiny_weights():
    return random_weights(tiny_config(), seed=0)


@pytest.fixture(scope="session")
def smollm():
    """The real embedded model, loaded once per test session."""
    from symphony.kernel.engine import Engine
    return Engine.load(config=EngineConfig(page_size=16, num_pages=1024), progress=False)


@pytest.fixture(scope="session")
def smollm_reference(smollm):
    from symphony.kernel.reference import ReferenceLlama
    return ReferenceLlama(smollm.model.w)     # the same weights, shared, not reloaded
