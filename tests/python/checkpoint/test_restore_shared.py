"""restore="shared": the pieces the ranks of a host need are read from storage once per host into
a /dev/shm buffer they share. Saved by 4 ranks (replicated state split in row pieces, a
ShardSpec-sharded tensor, DTensors sharded and replicated on a 1-D mesh, per-rank state), loaded
by 4, 3 and 2 ranks: bit-exact, the bytes read from storage equal what the job needs (all of it
at world 4; "direct" reads the replicated pieces once per rank), a corrupted piece raises on
every rank, a buffer that cannot be created falls back to direct reads, and no /dev/shm buffer
is left behind."""


from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=0, max_size=40), st.integers(1, 5),
       st.integers(1, 3000))
def test_device_rounds_keep_every_readers_order_and_cut_its_run_into_parts(sizes, world,
                                                                           round_bytes):
    """_run_device's broadcast order: every shared piece once; each reader's pieces in file
    order; a reader's part of a round ends at the first piece that reaches `round_bytes`."""
    from resilient.checkpoint.device_share import rounds as _rounds
    from resilient.checkpoint.host_share import layout as _layout

    names = [f"p{i}" for i in range(len(sizes))]
    entries = {n: {"nbytes": b} for n, b in zip(names, sizes)}
    _, _, share = _layout(names, entries, world, align=1)
    rounds = _rounds(names, share, entries, world, round_bytes)
    flat = [n for r in rounds for n in r]
    assert sorted(flat) == sorted(names) and all(r for r in rounds)
    for reader in range(world):
        run = [n for n in names if share[n] == reader]
        assert [n for n in flat if share[n] == reader] == run
        for batch in rounds:
            part = [entries[n]["nbytes"] for n in batch if share[n] == reader]
            assert not part or sum(part[:-1]) < round_bytes  # only its last piece reaches it
    assert rounds == _rounds(names, share, entries, world, round_bytes)  # deterministic


def test_shm_buffer_create_check_and_sweep(tmp_path):
    from resilient.checkpoint import shm

    header = shm.header_bytes(4)
    assert header == 4096 and shm.header_bytes(4, 1000) == 12288  # a word per reader and piece
    path = str(tmp_path / f"resilient-restore-{os.getpid()}-t1")
    shm.create(path, header + 8192, "abc")
    assert shm.check(path, header + 8192, "abc") is None
    assert "not the buffer" in shm.check(path, header + 8192, "abd")
    assert "not the buffer" in shm.check(path, header + 4096, "abc")
    assert "do not share" in shm.check(str(tmp_path / "missing"), 10, "abc")
    with pytest.raises(FileExistsError):
        shm.create(path, 10, "x")
    view = shm.open_mapped(path, header + 8192)
    assert bytes(view[:3].tolist()) == b"abc" and view.numel() == header + 8192
    progress = shm.Progress(view, 4, 3)
    assert [progress.get(i) for i in range(4)] == [0, 0, 0, 0]  # a new buffer: nothing read
    assert progress.pieces_done(0, 3) == bytes(3)
    progress.publish(2, 3)
    progress.publish(3, shm.Progress.FAILED)
    from resilient import _C

    _C.publish_i64(progress.piece_word(1), 7)  # as the engine marks a piece of 3 chunks in place
    _C.publish_i64(progress.piece_word(2), 4)  # 2 of its chunks in place, not yet the whole piece
    again = shm.Progress(shm.open_mapped(path, header + 8192), 4, 3)  # another mapping sees them
    assert [again.get(i) for i in range(4)] == [0, 0, 3, shm.Progress.FAILED]
    assert again.pieces_done(0, 3) == bytes([0, 1, 0])
    assert again.pieces_done(1, 2) == bytes([1, 0])  # from a piece on
    # the readers' queue lies in the header, before the readers' words and after the token;
    # a reader whose load is abandoned closes it (the others' engines claim no more)
    assert progress.queue % 8 == 0 and _C.observe_i64(progress.queue) == 0
    assert view.data_ptr() + len("abc") <= progress.queue < progress.piece_word(0)
    from resilient.checkpoint.host_share import RunReader

    reader = RunReader(lambda targets, queue: 0, lambda: 0, path, view, header, {}, {}, [], [],
                       {}, 0, progress, populate=True, queue=progress.queue)
    reader.stop()
    assert again.get(2) == 3 and _C.observe_i64(progress.queue) == shm.CLOSED
    with pytest.raises(OSError, match="too long"):
        shm.create(path + "-long", header, "x" * shm.QUEUE)  # the token stops short of it
    dead = tmp_path / "resilient-restore-999999999-t2"  # no such pid
    dead.write_bytes(b"x")
    assert shm.sweep(str(tmp_path)) == [dead.name]
    assert os.path.exists(path)  # this process's own buffer stays
    shm.unlink(path)
    shm.unlink(path)  # twice is fine
    assert not os.listdir(tmp_path)


def _mount_tmpfs(where, size: str):
    """A tmpfs of `size` at `where`, as a container's small /dev/shm (mounting needs root)."""
    import subprocess

    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")


def _umount(where) -> None:
    import subprocess

    subprocess.run(["umount", "-l", str(where)], check=False)


def test_shm_buffer_reserve_on_a_full_tmpfs_raises_enospc_not_sigbus(tiny_shm, monkeypatch):
    """The buffer is created sparse; each reader reserves the pages of its part before reading
    into them. On a tmpfs without room that is ENOSPC (run_shared then reads directly), not a
    SIGBUS when the pages are written; the same on kernels without MADV_POPULATE_WRITE, where
    posix_fallocate reserves them."""
    import errno

    from resilient.checkpoint import shm

    path = str(tiny_shm / f"resilient-restore-{os.getpid()}-t3")
    size = shm.header_bytes(2) + (4 << 20)  # 8x the tmpfs: creating it sparse is fine
    shm.create(path, size, "tag")
    view = shm.open_mapped(path, size)
    shm.reserve(path, view, 4096, 128 << 10)  # this much fits
    view[4096: 4096 + (128 << 10)] = 7  # and can be written
    with pytest.raises(OSError) as info:
        shm.reserve(path, view, 4096, 4 << 20)
    assert info.value.errno == errno.ENOSPC and "has no room" in str(info.value)

    class OldKernel:
        @staticmethod
        def populate_write(addr, nbytes):
            return errno.EINVAL

    monkeypatch.setattr(shm, "_C", OldKernel)
    shm.reserve(path, view, 8192, 64 << 10)
    with pytest.raises(OSError) as info:
        shm.reserve(path, view, 4096, 4 << 20)
    assert info.value.errno == errno.ENOSPC
    del view
    shm.unlink(path)
    assert not os.listdir(tiny_shm)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 100_000), max_size=40), st.data())
def test_spans_cover_a_runs_pieces_and_nothing_else(sizes, data):
    """host_share.spans (the ranges a reader reserves): every piece of its run, laid out as
    layout does, is covered by disjoint ranges that hold no other piece."""
    from resilient.checkpoint.host_share import layout, spans

    names = [f"p{i}" for i in range(len(sizes))]
    entries = {n: {"nbytes": b} for n, b in zip(names, sizes)}
    where, _, _ = layout(names, entries, 1)
    run = data.draw(st.lists(st.sampled_from(names), unique=True)) if names else []
    ranges = spans(run, where, entries)
    assert all(a < b for a, b in ranges)
    assert all(b <= c for (_, b), (c, _) in zip(ranges, ranges[1:]))
    for n in run:
        lo, hi = where[n], where[n] + entries[n]["nbytes"]
        assert any(a <= lo and hi <= b for a, b in ranges), (n, ranges)
    for m in set(names) - set(run):
        lo, hi = where[m], where[m] + entries[m]["nbytes"]
        assert not any(lo < b and a < hi for a, b in ranges), (m, ranges)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 10_000_000), max_size=40), readers=st.integers(1, 9))
def test_layout_places_pieces_apart_aligned_and_balances_readers(sizes, readers):
    from resilient.checkpoint.host_share import layout as _layout

    entries = {f"e{i}": {"nbytes": n} for i, n in enumerate(sizes)}
    where, size, share = _layout(list(entries), entries, readers)
    spans = sorted((where[n], where[n] + e["nbytes"]) for n, e in entries.items())
    assert all(a % 4096 == 0 for a, _ in spans)
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))  # no overlap
    assert all(b <= size for _, b in spans) and size < sum(sizes) + 4096 * (len(sizes) + 1)
    order = [share[n] for n in entries]
    assert order == sorted(order)  # each reader one contiguous run of the files
    load = [sum(e["nbytes"] for n, e in entries.items() if share[n] == r) for r in range(readers)]
    assert max(load) - min(load) <= 2 * max(sizes, default=0)  # within a piece at each end


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 5_000_000), max_size=30),
       host_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5), data=st.data())
def test_exchange_plan_delivers_every_run_to_every_other_host_once(sizes, host_sizes, data):
    """The exchange between hosts: every rank reads one contiguous run of the common pieces, the
    runs tile the buffer's common part, and each run reaches every other host exactly once (and
    never its own), each host's receives spread over its ranks by position."""
    from resilient.checkpoint import exchange
    from resilient.checkpoint.host_share import layout as _layout

    world = sum(host_sizes)
    names = data.draw(st.permutations([f"h{h}" for h, n in enumerate(host_sizes)
                                       for _ in range(n)]))  # hosts interleaved over ranks
    hosts = exchange.Hosts.of(names)
    entries = {f"e{i}": {"nbytes": n} for i, n in enumerate(sizes)}
    common = list(entries)
    where, size, share = _layout(common, entries, world)
    runs = exchange.runs(hosts, common, where, share, size)
    spans = sorted(runs.values())
    if common:
        assert spans[0][0] == 0 and spans[-1][1] == size
    assert all(b == c for (_, b), (c, _) in zip(spans, spans[1:]))  # tiles [0, size)
    for n in common:  # each piece lies inside its reader's run
        lo, hi = runs[hosts.order[share[n]]]
        assert lo <= where[n] and where[n] + entries[n]["nbytes"] <= hi
    plan = exchange.transfers(hosts, runs)
    for host, ranks in hosts.ranks.items():
        got = sorted((t.lo, t.hi) for t in plan if t.dst in ranks)
        read_here = sorted(runs[r] for r in ranks if r in runs and runs[r][0] < runs[r][1])
        assert sorted(got + read_here) == [s for s in spans if s[0] < s[1]]  # all, once
        for t in plan:
            if t.dst in ranks:
                assert hosts.host_of(t.src) != host
                pos = hosts.ranks[hosts.host_of(t.src)].index(t.src)
                assert t.dst == ranks[pos % len(ranks)]


def test_exchange_mismatches_name_errors_and_altered_runs():
    from resilient.checkpoint.exchange import Transfer, mismatches

    plan = [Transfer(0, 1, 0, 10), Transfer(1, 0, 10, 20)]
    good = [{"sent": 5, "got": {1: 6}, "error": None}, {"sent": 6, "got": {0: 5}, "error": None}]
    assert mismatches(good, plan) == []
    altered = [good[0], {"sent": 6, "got": {0: 4}, "error": None}]
    assert mismatches(altered, plan) == ["bytes 0..10 from rank 0 at rank 1"]
    failed = [good[0], {"sent": None, "got": {}, "error": "rank 1: OSError: x"}]
    assert mismatches(failed, plan)[0] == "rank 1: OSError: x"
    assert len(mismatches(failed, plan)) == 3  # its run was not sent, rank 0's not received


class _Words:
    """host_share.Arrivals' view of a buffer's header (shm.Progress), in memory: piece words
    set by the test, in the order it draws, and readers that fail."""

    def __init__(self, pieces: int, readers: int):
        self.done, self.state = bytearray(pieces), [0] * readers

    def get(self, reader: int) -> int:
        return self.state[reader]

    def pieces_done(self, first: int, count: int) -> bytes:
        return bytes(self.done[first: first + count])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=5), st.integers(1, 8), st.data())
def test_arrivals_take_each_wanted_piece_once_after_it_landed(lengths, window, data):
    """host_share.Arrivals, whatever order the pieces land in and whatever window: take()
    returns only pieces that landed and this rank wants, each once; once all landed nothing is
    left; a reader's failure is seen while its pieces are outstanding."""
    from resilient.checkpoint import shm
    from resilient.checkpoint.host_share import Arrivals

    runs = [[f"r{i}p{j}" for j in range(n)] for i, n in enumerate(lengths)]
    index = {n: k for k, n in enumerate(n for run in runs for n in run)}
    wanted = set(data.draw(st.lists(st.sampled_from(sorted(index)), unique=True))
                 if index else [])
    words = _Words(len(index), len(runs))
    arrivals = Arrivals(words, runs, index, wanted, timeout=1.0, window=window)
    order = data.draw(st.permutations(sorted(index)))
    fail_at = data.draw(st.none() | st.integers(0, len(order)))
    taken: list[str] = []
    for step, n in enumerate(order):
        if step == fail_at:  # a reader with pieces still out fails
            open_readers = [i for i, run in enumerate(runs)
                            if any(words.done[index[m]] == 0 for m in run)]
            words.state[open_readers[0]] = shm.Progress.FAILED
            wants_from_it = any(m in wanted and m not in taken for m in runs[open_readers[0]])
            assert arrivals.is_completed() or not wants_from_it
            if wants_from_it:
                assert arrivals.failed
            return
        words.done[index[n]] = 1
        if arrivals.is_completed():
            got = arrivals.take()
            assert all(words.done[index[m]] and m in wanted for m in got)
            taken += got
    while arrivals.left() and arrivals.is_completed():  # the window moves on
        taken += arrivals.take()
    assert sorted(taken) == sorted(wanted)
    assert not arrivals.left() and not arrivals.failed
