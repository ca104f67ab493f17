"""Fixtures of the worker's tests.

``tiny`` (module)
    ``(checkpoint, head)``: a tiny random checkpoint of the real layout and a random DFlash2 head
    for it, written under the module's temporary directory.
"""

import pytest

from worker.demo.layout import write_random_checkpoint
from worker.dflash.draft import write_random_head


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    ckpt = write_random_checkpoint(root / "ckpt")
    return ckpt, write_random_head(ckpt, root / "head")
