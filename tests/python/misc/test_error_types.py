"""Every exception type the package defines is a resilient.errors.ResilientError (one `except`
catches whatever resilient raises of its own), defined in resilient.errors, except the few
listed below with the reason each must derive from something else."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import resilient
from resilient.errors import ResilientError

#: name -> why it is not a ResilientError (an allow-list that only shrinks).
OTHERS = {
    # torch.distributed's own error types, so that Recovery and torch's elastic agent classify
    # a lost store as a collective failure: errors.py must not import torch (ckpt ls, bench)
    "resilient.etcd.StoreUnreachableError": "a torch.distributed.DistError",
    "resilient.etcd.StoreTimeoutError": "a torch.distributed.DistStoreError",
    "resilient.etcd.StoreConnectionError": "a torch.distributed.DistNetworkError",
    # the launcher's own signal to itself, never seen by a training script
    "resilient.recovery.agent.WorkerKilledError": "internal to resilient run's agent",
}


def _defined_exceptions() -> dict[str, type]:
    found = {}
    for info in pkgutil.walk_packages(resilient.__path__, "resilient."):
        if info.name.endswith("__main__") or info.name == "resilient.run":
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == info.name):
                found[f"{info.name}.{name}"] = obj
    return found


def test_every_exception_is_a_resilient_error_defined_in_errors() -> None:
    found = _defined_exceptions()
    assert "resilient.errors.PeerFailure" in found  # the walk sees the package's modules
    wrong = {name: [b.__name__ for b in cls.__mro__[1:]] for name, cls in found.items()
             if name not in OTHERS
             and (not issubclass(cls, ResilientError) or cls.__module__ != "resilient.errors")}
    assert not wrong, wrong
    assert set(OTHERS) <= set(found), set(OTHERS) - set(found)  # the allow-list only shrinks


def test_recoverys_errors_are_the_same_types_where_they_were() -> None:
    from resilient import errors
    from resilient.recovery import decisions, gate, reshard

    assert decisions.PeerFailure is errors.PeerFailure
    assert decisions.RecoveryStopped is errors.RecoveryStopped
    assert gate.GateAbandoned is errors.GateAbandoned
    assert reshard.ReplicaUnavailable is errors.ReplicaUnavailable
    assert issubclass(errors.GateAbandoned, RuntimeError)  # as before (it was one)
