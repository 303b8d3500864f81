"""NCCL environment that in-process recovery needs.

NCCL's RAS subsystem (a background thread in every process, on by default since 2.24) tracks
peers and communicators. Recovery is exactly what it handles worst: peers die, communicators are
shrunk and replaced while its thread updates its peer tables. NCCL up to 2.28.9 can crash that
thread with SIGSEGV (NVIDIA/nccl#1996 in 2.27.7, use-after-free in rasMsgHandlePeersUpdate fixed
after 2.28.9 by NVIDIA/nccl#2406). RAS only serves the `ncclras` status client, so resilient turns
it off unless the user chose otherwise.
"""

from __future__ import annotations

import os

RAS_VARIABLE = "NCCL_RAS_ENABLE"


def prepare_nccl_env() -> bool:
    """Sets NCCL_RAS_ENABLE=0 unless it is set already; returns True when it set it.

    NCCL reads the variable when the process creates its first communicator, so call this before
    that (resilient's process-group helpers and ``load_nccl`` do).
    """
    if RAS_VARIABLE in os.environ:
        return False
    os.environ[RAS_VARIABLE] = "0"
    return True
