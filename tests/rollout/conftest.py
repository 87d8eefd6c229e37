"""The slot engine's and the paged engine's tests share one tiny model and its prompts."""
import pytest
from test_engine import tiny_model, tiny_prompts


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def prompts():
    return tiny_prompts()
