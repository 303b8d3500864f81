"""restore="shared": the pieces the ranks of a host need are read from storage once per host into
a /dev/shm buffer they share. Saved by 4 ranks (replicated state split in row pieces, a
ShardSpec-sharded tensor, DTensors sharded and replicated on a 1-D mesh, per-rank state), loaded
by 4, 3 and 2 ranks: bit-exact, the bytes read from storage equal what the job needs (all of it
at world 4; "direct" reads the replicated pieces once per rank), a corrupted piece raises on
every rank, a buffer that cannot be created falls back to direct reads, and no /dev/shm buffer
is left behind.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_restore_shared.py."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from test_restore_shared import _mount_tmpfs, _umount

from procs import run_bounded

ROWS = 24


def _state(rank: int, world: int, mesh):
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from resilient.checkpoint import ShardSpec

    rep = torch.arange(3000 * 100, dtype=torch.float32).reshape(3000, 100)  # > split_bytes
    full = torch.arange(ROWS * 8, dtype=torch.float64).reshape(ROWS, 8)
    n = ROWS // world
    specs = {"w": ShardSpec.split((ROWS, 8), 0, rank, world)}
    dt = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)  # uneven chunks at 3 and 4
    dr = torch.arange(500, dtype=torch.bfloat16)
    return {"rep": rep, "w": full[rank * n:(rank + 1) * n].clone(), "i": 7,
            "dt": distribute_tensor(dt, mesh, [Shard(0)]),
            "dr": distribute_tensor(dr, mesh, [Replicate()])}, specs


FROZEN_S = 20  # how long the "frozen" phase's rank stays stopped


def _same(a, b) -> bool:
    import torch

    local = [x.to_local() if hasattr(x, "to_local") else x for x in (a, b)]
    return torch.equal(*local)


def _worker(rank: int, world: int, port: int, phases: str, root: str, out: str) -> None:
    """Runs the comma-separated `phases` one after the other in one process group (each
    process start costs seconds of imports on a small machine)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from resilient.checkpoint import shm

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    shm_dir, native = shm.DIR, shm._C
    for phase in phases.split(","):
        result = _phase(rank, world, mesh, phase, root, out)
        shm.DIR, shm._C = shm_dir, native  # as the phase found them
        dist.barrier()
        _report(result, phase, world, rank, out)
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def _phase(rank: int, world: int, mesh, phase: str, root: str, out: str) -> dict:
    import torch
    from torch.distributed.tensor import distribute_tensor

    import resilient
    from resilient.checkpoint import shm

    expect, specs = _state(rank, world, mesh)
    result: dict = {}
    if phase == "save":
        with resilient.Checkpointer(root, keep=0, create=True, specs=specs) as ck:
            ck.save(1, expect, {"r": torch.tensor([rank])}).wait()
        return result
    mode = {"nobuffer": "shared", "notshared": "shared", "dies": "shared", "fullshm": "shared",
            "corrupt": "shared", "frozen": "shared", "frozenread": "shared",
            "noroom": "shared", "fullhosts": "shared", "lateread": "shared"}.get(phase, phase)
    kwargs: dict = {}
    if phase == "lateread":  # one host: rank 1's reads start late; the others read its share
        from resilient.checkpoint import host_share

        real_read = host_share.RunReader._read_run

        def late(self, progress):
            if rank == 1:
                time.sleep(3)
            real_read(self, progress)
            result["host_read"] = self.bytes_read  # its engine's, before its own pieces'

        host_share.RunReader._read_run = late  # put back below
    if phase == "frozenread":  # one host: rank 1 stops (SIGSTOP) as its reader thread starts
        from resilient.checkpoint import host_share

        kwargs = {"timeout": 4}
        if rank == 1:
            host_share.RunReader.run = lambda self: _freeze()
    if phase == "frozen":  # 4 emulated hosts: every rank sends its run to every other rank;
        from datetime import timedelta  # rank 1 stops (SIGSTOP) as its exchange begins

        import torch.distributed as dist

        from resilient.checkpoint import exchange

        os.environ["RESILIENT_HOST_ID"] = f"host-{rank}"
        # the load's group outlives the frozen peer by far: only the checkpointer's own
        # timeout (4 s) may end the others' waits
        kwargs = {"timeout": 4, "group": dist.new_group(backend="gloo",
                                                        timeout=timedelta(seconds=300))}
        if rank == 1:
            exchange._over_group = lambda *_: _freeze()
    if phase.startswith("hosts"):  # hosts2: 2 emulated hosts of 2 ranks; hosts4: 4 of 1
        per_host = world // int(phase[5])
        os.environ["RESILIENT_HOST_ID"] = f"host-{rank // per_host}"
        mode = "shared"
    if phase == "hosts2" and rank == 2:  # host 1's first rank: the first run it
        import torch.distributed as dist  # receives arrives with a byte flipped

        real = dist.irecv

        class Flipped:
            def __init__(self, work, tensor):
                self.work, self.tensor = work, tensor

            def wait(self):
                self.work.wait()
                self.tensor[100] ^= 0x01

        def irecv(tensor, *args, **kwargs):
            dist.irecv = real
            return Flipped(real(tensor, *args, **kwargs), tensor)

        dist.irecv = irecv
    if phase == "corrupt":  # the test's copy with a damaged piece
        root = root + "-corrupt"
    if phase in ("fullshm", "fullhosts"):  # a tmpfs too small for the buffer(s)
        shm.DIR = os.environ["TEST_SMALL_SHM"]
    if phase == "fullhosts":  # 2 emulated hosts, whose buffers share that tmpfs
        os.environ["RESILIENT_HOST_ID"] = f"host-{rank // 2}"
    if phase == "noroom" and rank == 1:  # its pages cannot be had, as on a full /dev/shm
        import errno

        class NoRoom:
            def __getattr__(self, name):
                return getattr(native, name)

            @staticmethod
            def populate_write(addr, nbytes):
                return errno.EFAULT

        native = shm._C
        shm._C = NoRoom()
    if phase == "nobuffer":  # the buffer cannot be created
        shm.DIR = "/nonexistent-shm-dir"
    if phase == "notshared" and rank > 0:  # rank 0 creates it where the others do not look
        shm.DIR = out
    if phase == "dies" and rank == 1:  # dies after the buffer exists, before the reads agree
        shm.open_mapped = lambda *_: os._exit(0)
    target = {"rep": torch.zeros(3000, 100), "w": torch.zeros_like(expect["w"]), "i": 0}
    for k in ("dt", "dr"):
        target[k] = distribute_tensor(torch.zeros_like(expect[k].full_tensor()), mesh,
                                      expect[k].placements)
    mine = {"r": torch.tensor([-1])}
    with resilient.Checkpointer(root, specs=specs, restore=mode,
                                collective_timeout=10 if phase == "dies" else None,
                                **kwargs) as ck:
        started = time.monotonic()
        try:
            result["step"] = ck.load(target, mine)
            result["same"] = all(_same(target[k], expect[k]) for k in ("rep", "w", "dt", "dr"))
            result["i"], result["r"] = target["i"], int(mine["r"])
            result["bytes_read"] = ck.last_load.bytes_read
        except Exception as e:  # noqa: BLE001 -- reported to the test
            result["error"] = f"{type(e).__name__}: {e}"
        result["seconds"] = time.monotonic() - started
        if phase == "hosts2":  # the tampered exchange fell back; now the real one
            os.environ["RESILIENT_HOST_ID"] = f"host-{rank // 2}"
            result["tampered_bytes_read"] = result.pop("bytes_read", None)
            result["tampered_same"] = result.pop("same", None)
            target["rep"].zero_()
            result["step"] = ck.load(target, mine)
            result["same"] = all(_same(target[k], expect[k]) for k in ("rep", "w", "dt", "dr"))
            result["bytes_read"] = ck.last_load.bytes_read
        os.environ.pop("RESILIENT_HOST_ID", None)
        if phase == "lateread":
            host_share.RunReader._read_run = real_read
        if phase in ("dies", "frozen", "frozenread"):  # no barrier, no close: a rank is gone
            _report(result, phase, world, rank, out)
            if phase.startswith("frozen"):  # the job's store lives in rank 0: it stays until the
                deadline = time.monotonic() + 60  # others reported (their waits read it)
                while time.monotonic() < deadline and not all(
                        os.path.exists(os.path.join(out, f"{phase}-{world}-{r}.json"))
                        for r in range(world) if r != 1):
                    time.sleep(0.1)
            sys.stdout.flush()
            os._exit(0)
    return result


def _freeze() -> None:
    """Stops this process for FROZEN_S (SIGSTOP from outside: one that a thread sends its own
    process did not hold here, it continued at once), then ends it: the others are gone."""
    import subprocess

    pid = os.getpid()
    subprocess.Popen(["sh", "-c", f"kill -STOP {pid}; sleep {FROZEN_S}; kill -CONT {pid}"])
    time.sleep(2)  # stopped in here
    os._exit(0)


def _report(result: dict, phase: str, world: int, rank: int, out: str) -> None:
    # this job's buffers only (named after the creator's pid): other jobs may run at once
    mine = f"resilient-restore-{os.getpid()}-"
    result["leftovers"] = [n for n in os.listdir("/dev/shm") if n.startswith(mine)]
    from resilient.checkpoint import shm

    if shm.releasing is not None:  # the buffer is unmapped on a thread, after the load
        shm.releasing.join(30)
    with open("/proc/self/maps") as f:  # and no buffer still mapped
        result["mapped"] = [line for line in f if "resilient-restore-" in line]
    with open(os.path.join(out, f"{phase}-{world}-{rank}.json"), "w") as f:
        json.dump(result, f)


def _run(phases: str, world: int, root, out,
         ranks: dict[str, tuple[int, ...]] | None = None) -> dict[str, list[dict]]:
    """Each phase's results (rank order; `ranks` names the reporting ranks of a phase where not
    all of them report) from one process group running `phases`."""
    rc, output = run_bounded([sys.executable, __file__, phases, str(world), str(root),
                              str(out)], 240, f"{phases} at {world}")
    assert rc == 0, output[-4000:]
    return {phase: [json.load(open(out / f"{phase}-{world}-{r}.json"))
                    for r in (ranks or {}).get(phase, range(world))]
            for phase in phases.split(",")}


def _size(root) -> int:
    import resilient

    with resilient.Checkpointer(root) as ck:
        return sum(e["nbytes"] for e in ck._native.manifest(1).tensors())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint saved by 4 ranks, once for this module's tests (each loads a copy)."""
    out = tmp_path_factory.mktemp("saved")
    _run("save", 4, out / "ckpt", out)
    return out / "ckpt"


def _copy(saved, tmp_path, name: str = "ckpt"):
    import shutil

    return shutil.copytree(saved, tmp_path / name, symlinks=True)


def _corrupt(root) -> None:
    """Flips bytes inside the first data file's extents."""
    step = root / "step-000000000001"
    data = sorted(p for p in step.rglob("*") if p.is_file() and p.stat().st_size > 100_000)
    assert data, list(step.rglob("*"))
    with open(data[0], "r+b") as f:
        f.seek(8192)
        chunk = bytearray(f.read(64))
        f.seek(8192)
        f.write(bytes(b ^ 0xFF for b in chunk))


@pytest.fixture(scope="module")
def at4(saved, tmp_path_factory):
    """Every 4-rank load of this module's tests, in one job (each process start costs seconds of
    imports on a small machine): shared and direct reads of a copy of `saved`, shared reads of
    a copy with a corrupted piece, and last a rank that dies mid-load (the job ends there).
    Returns (the first copy's root, each phase's results)."""
    out = tmp_path_factory.mktemp("at4")
    root = _copy(saved, out)
    _corrupt(_copy(saved, out, "ckpt-corrupt"))
    # rank 1 exits in the load of "dies"
    return root, _run("shared,direct,corrupt,hosts2,hosts4,lateread,dies", 4, root, out,
                      ranks={"dies": (0, 2, 3)})


@pytest.mark.timeout(900)
def test_shared_restore_reads_each_byte_once_per_host(at4, tmp_path):
    root, at4 = at4
    size = _size(root)
    for r, g in enumerate(at4["shared"]):
        assert g.get("error") is None, g
        assert g["step"] == 1 and g["same"] and g["i"] == 7 and g["r"] == r
        assert g["bytes_read"] == size  # every byte of the checkpoint, once
        assert not g["leftovers"] and not g["mapped"], g
    direct = at4["direct"]
    assert direct[0]["same"] and direct[0]["bytes_read"] > 2 * size  # replicated: once per rank
    # resharded: rank_state of the ranks >= world is not read; then a buffer that cannot be
    # created, one the other ranks cannot see, and one whose pages a reader cannot reserve
    # (a full /dev/shm): every rank reads directly instead
    at3 = _run("shared,nobuffer,notshared,noroom", 3, root, tmp_path)
    at2 = _run("shared", 2, root, tmp_path)
    for got in (at3["shared"], at2["shared"]):
        assert all(g.get("error") is None and g["same"] for g in got), got
        assert got[0]["bytes_read"] < size
        assert not any(g["leftovers"] or g["mapped"] for g in got), got
    for phase in ("nobuffer", "notshared", "noroom"):
        fallback = at3[phase]
        assert all(g.get("error") is None and g["same"] for g in fallback), fallback
        assert fallback[0]["bytes_read"] > size  # replicated pieces read by every rank
        assert not any(g["leftovers"] or g["mapped"] for g in fallback), fallback


@pytest.mark.timeout(300)
def test_the_hosts_readers_share_one_queue_so_a_late_reader_holds_back_nothing(at4):
    """One host of 4 ranks whose reads come from one queue (Linux 5.14 on): rank 1's reader
    starts 3 s late, after the other three read everything the host shares, its share
    included. Every rank restores everything, each byte read once."""
    root, at4 = at4
    got = at4["lateread"]
    for g in got:
        assert g.get("error") is None and g["same"] and g["step"] == 1, g
        assert g["bytes_read"] == _size(root)
        assert not g["leftovers"] and not g["mapped"], g
    import torch

    from resilient.checkpoint import shm

    if not shm.can_populate(torch.zeros(8192, dtype=torch.uint8)):  # the kernel's answer
        pytest.skip("before Linux 5.14 each rank reads a fixed run")
    assert got[1]["host_read"] == 0, [g["host_read"] for g in got]
    assert sum(g["host_read"] for g in got) > 0


@pytest.mark.timeout(300)
def test_across_hosts_each_byte_is_read_once_and_what_crossed_is_checked(at4):
    """Two emulated hosts of two ranks and four of one (RESILIENT_HOST_ID): the pieces every
    host needs are read from storage once in all and each rank sends what it read to a rank of
    every other host, so the job reads the checkpoint's size, not one copy per host. A run that
    arrives altered (a byte flipped after receiving, on host 1's first rank) fails the XXH3
    check on every rank, which then reads directly: the state is still exact."""
    root, at4 = at4
    size = _size(root)
    for phase in ("hosts2", "hosts4"):
        for r, g in enumerate(at4[phase]):
            assert g.get("error") is None, (phase, g)
            assert g["step"] == 1 and g["same"] and g["i"] == 7 and g["r"] == r, (phase, g)
            assert g["bytes_read"] == size, (phase, g)  # once across the hosts
            assert not g["leftovers"] and not g["mapped"], g
    for g in at4["hosts2"]:
        assert g["tampered_same"], g
        assert g["tampered_bytes_read"] > size, g  # the fallback: direct reads


@pytest.mark.timeout(300)
def test_a_corrupt_piece_raises_on_every_rank_and_leaves_no_buffer(at4):
    for g in at4[1]["corrupt"]:
        assert "error" in g and "Corrupt" in g["error"], g
        assert not g["leftovers"] and not g["mapped"], g


@pytest.mark.timeout(300)
def test_a_rank_that_dies_mid_load_leaves_no_buffer(at4):
    for g in at4[1]["dies"]:
        assert "error" in g, g
        # rank 0 created it and unlinked it on the way out; the error maps no buffer
        assert not g["leftovers"] and not g["mapped"], g


@pytest.mark.timeout(300)
def test_a_peer_frozen_mid_exchange_fails_the_load_within_its_timeout(saved, tmp_path):
    """Four emulated hosts (the exchange between them over gloo); rank 1 stops (SIGSTOP) as its
    exchange begins and stays stopped for FROZEN_S. The others raise CollectiveError naming the
    stopped step within the checkpointer's timeout (4 s here), not after the load group's own
    gloo timeout (300 s) or when the peer comes back; no /dev/shm buffer is left. (The
    exchange's thread, still in gloo's wait, keeps the unlinked buffer mapped until that
    timeout: not checked here.)"""
    root = _copy(saved, tmp_path)
    got = _run("frozen", 4, root, tmp_path, ranks={"frozen": (0, 2, 3)})["frozen"]
    for g in got:
        assert "CollectiveError" in g.get("error", "") and "within 4 s" in g["error"], g
        assert g["seconds"] < FROZEN_S - 10, g  # ended by the timeout, not by the peer's return
        assert not g["leftovers"]


@pytest.mark.timeout(300)
def test_a_full_dev_shm_makes_every_rank_read_directly(tiny_shm, saved, tmp_path,
                                                        monkeypatch):
    """Two ranks, their host's /dev/shm a 512 KiB tmpfs: a reader's reserve fails, every rank
    learns it in the gather after the reads and reads directly; the state is exact and the
    buffer is gone."""
    monkeypatch.setenv("TEST_SMALL_SHM", str(tiny_shm))
    root = _copy(saved, tmp_path)
    got = _run("fullshm", 2, root, tmp_path)["fullshm"]
    for g in got:
        assert g.get("error") is None and g["same"], g
        assert g["bytes_read"] > _size(root) // 2, g  # replicated pieces read by every rank
    assert not os.listdir(tiny_shm)


@pytest.mark.timeout(300)
def test_pages_received_from_another_host_are_reserved_before_they_are_written(saved, tmp_path,
                                                                              monkeypatch):
    """Two emulated hosts of two ranks, whose buffers (about 1.2 MB each) share one 1600 KiB
    tmpfs: the pages each host reads itself fit, those it receives from the other host do not.
    Every page a rank writes, read or received, is reserved before any is written, so a rank
    finds the tmpfs full there, not as a SIGBUS in the exchange, and every rank reads
    directly: the state is exact and no buffer is left."""
    where = tmp_path / "shm-1600k"
    _mount_tmpfs(where, "1600k")
    try:
        monkeypatch.setenv("TEST_SMALL_SHM", str(where))
        root = _copy(saved, tmp_path)
        got = _run("fullhosts", 4, root, tmp_path)["fullhosts"]
        for g in got:
            assert g.get("error") is None and g["same"], g
            assert g["bytes_read"] > _size(root), g  # the fallback: direct reads
        assert not os.listdir(where)
    finally:
        _umount(where)


@pytest.mark.timeout(300)
def test_a_frozen_reader_of_the_host_fails_the_load_within_its_timeout(saved, tmp_path):
    """One host of 4 ranks: rank 1 stops (SIGSTOP) as its reader thread starts, so its parts of
    the host's buffer never arrive. The others, copying parts out as they arrive, raise
    CollectiveError within the checkpointer's timeout (4 s), not when the peer comes back."""
    root = _copy(saved, tmp_path)
    got = _run("frozenread", 4, root, tmp_path, ranks={"frozenread": (0, 2, 3)})["frozenread"]
    for g in got:
        assert "CollectiveError" in g.get("error", "") and "within 4 s" in g["error"], g
        assert g["seconds"] < FROZEN_S - 10, g
        assert not g["leftovers"] and not g["mapped"], g


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from resilient.ports import free_port

    port = free_port()
    phase, world = sys.argv[1], int(sys.argv[2])
    mp.start_processes(_worker, args=(world, port, phase, sys.argv[3], sys.argv[4]),
                       nprocs=world, start_method="spawn")
