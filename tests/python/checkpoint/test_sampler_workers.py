"""Resuming a DataLoader with workers exactly (issue 44, item 3).

A DataLoader with workers draws indices ahead of the loop (prefetch_factor batches per worker),
and with several epochs the sampler may even finish an epoch before the loop does. A
ResumableSampler counts what the loop received (the batches the DataLoader yielded), so a
checkpoint taken at any batch resumes with the next batch. Where that count cannot be exact it
raises at save. torchdata's StatefulDataLoader is saved as a rank_state entry like any
Stateful object.
"""


from __future__ import annotations

import pytest
from torch.utils.data import (
    DataLoader,
)

from resilient import forever


def test_forever_over_a_loader_with_no_batch_raises_instead_of_spinning():
    loader = DataLoader(list(range(3)), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match="no batch in a whole epoch"):
        next(forever(loader))
