"""The cost of a checkpoint collective's entry and first gather (Ranks.enter + Ranks.gather, as
save() makes them) over the arrival skew between ranks: 2 gloo processes, rank 1 arriving 0, 1,
3 and 8 ms after rank 0, 150 rounds each; prints rank 0's median time minus the skew.

python benchmarks/collective_entry.py LABEL
"""

from __future__ import annotations

import statistics
import sys
import time

import torch.multiprocessing as mp

SKEWS_S = (0.0, 0.001, 0.003, 0.008)


def worker(rank: int, port: int, label: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from resilient.checkpoint.ranks import Ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    ranks = Ranks(True, None, None, 60, 30)
    medians = {}
    for skew in SKEWS_S:
        took = []
        for i in range(150):
            dist.barrier(group=ranks.group)
            if rank == 1:
                time.sleep(skew)
            t0 = time.perf_counter()
            ranks.enter("save", i)
            ranks.gather((12345, None, [], None))  # save()'s gather: plan key, prints, ...
            took.append(time.perf_counter() - t0)
        medians[skew] = statistics.median(took[20:])
    if rank == 0:
        print(label, " ".join(f"skew {k * 1e3:.0f} ms: +{(v - k) * 1e3:.2f} ms"
                              for k, v in medians.items()), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from resilient.ports import free_port

    mp.start_processes(worker, args=(free_port(), sys.argv[1] if len(sys.argv) > 1 else ""),
                       nprocs=2, start_method="spawn")
