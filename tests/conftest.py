import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models on a 2-core machine run much faster single-threaded (and deterministically)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
