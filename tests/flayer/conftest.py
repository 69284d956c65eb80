"""The tiny models here run fastest on one thread; two threads on a busy 2-core machine thrash
(measured 10x slower). Restored afterwards for the rest of the suite."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
