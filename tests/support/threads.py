"""`one_thread`: imported into a test module, its tests run torch with one intra-op thread (tiny
matrices: one thread is fastest, and it does not oversubscribe a 2-core box)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
