import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Everything under tests/gpu is marked `gpu` and skipped on a machine without CUDA."""
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
