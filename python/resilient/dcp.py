"""torch.distributed.checkpoint (DCP) through resilient's engine (docs/dcp.md).

    import torch.distributed.checkpoint as dcp
    from resilient.dcp import ResilientStorageReader, ResilientStorageWriter, ResilientStager

    dcp.save(state, storage_writer=ResilientStorageWriter("/ckpt/run42"))   # commits a step
    dcp.load(state, storage_reader=ResilientStorageReader("/ckpt/run42"))   # the newest step

    writer = ResilientStorageWriter("/ckpt/run42")
    fut = dcp.async_save(state, storage_writer=writer, async_stager=ResilientStager(writer))

DCP's planners decide what each rank writes and reads (resharding included); resilient stores
each save as one crash-consistently committed step of a checkpoint root: io_uring writes, a
checksum per chunk, DCP's metadata as checksummed JSON, no pickle in anything resilient writes
(bytes items, DCP's serialized non-tensor values, are stored as the opaque bytes they are). The
design is written out at the top of resilient/checkpoint/dcp_storage.py.
"""

from __future__ import annotations

from resilient.checkpoint.dcp_stager import ResilientStager
from resilient.checkpoint.dcp_storage import (
    ResilientStorageReader,
    ResilientStorageWriter,
    locate,
)

__all__ = ["ResilientStager", "ResilientStorageReader", "ResilientStorageWriter", "locate"]
