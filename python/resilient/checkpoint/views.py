"""How modules and optimizers appear in a checkpoint: by parameter name, whatever wraps them.

A module's state is saved under its canonical names: the keys of ``state_dict()`` without the
parts that wrappers add (DDP's and DataParallel's leading ``module.``, ``torch.compile``'s
``_orig_mod``, activation checkpointing's ``_checkpoint_wrapped_module`` and FSDP1's
``_fsdp_wrapped_module``). FSDP2 and tensor parallelism keep the names, so a model saved under
DDP loads into the same model under FSDP2, compiled or not, and the other way round.

An optimizer's state is saved keyed by the canonical name (FQN) of each parameter, in the layout
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` produces::

    {"state": {"layers.0.w": {"step": ..., "exp_avg": ...}, ...},
     "param_groups": [{"lr": ..., ..., "params": ["layers.0.w", ...]}, ...]}

when the state being saved also holds a module that owns every parameter of the optimizer (the
usual ``{"model": model, "optim": optim}``). A load maps the names back onto the target
optimizer's own parameters, so a changed wrapping or parameter order still loads; its
parameter groups are matched by the names they hold. An optimizer saved without such a module,
or saved by resilient before this layout, keeps ``Optimizer.state_dict()``'s positional ids,
and loads positionally as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from resilient.checkpoint import codec

# Name parts that wrappers insert anywhere in a module's state-dict keys.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def _leading_parts(m: torch.nn.Module) -> list[str]:
    """The key prefix that DDP/DataParallel and torch.compile wrappers around `m` add."""
    parts: list[str] = []
    while True:
        if isinstance(m, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            parts.append("module")
            m = m.module
        elif isinstance(getattr(m, "_orig_mod", None), torch.nn.Module):
            parts.append("_orig_mod")
            m = m._orig_mod
        else:
            return parts


def _renamer(m: torch.nn.Module, keys: list[str]) -> dict[str, str] | None:
    """raw key -> canonical key for `m`'s keys; None when nothing changes or two keys would
    collide (then the raw keys are used)."""
    lead = _leading_parts(m)
    if not lead and not any(p in k for k in keys for p in _WRAPPER_PARTS):
        return None  # the common case, decided without splitting every key

    def canon(k: str) -> str:
        parts = k.split(".")
        if parts[:len(lead)] == lead:
            parts = parts[len(lead):]
        return ".".join(p for p in parts if p not in _WRAPPER_PARTS)

    names = {k: canon(k) for k in keys}
    if all(k == v for k, v in names.items()) or len(set(names.values())) != len(names):
        return None
    return names


def canonical_name(key: str) -> str:
    """`key` without wrapper parts other than a leading ``module.`` (used for error hints)."""
    parts = key.split(".")
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(p for p in parts if p not in _WRAPPER_PARTS)


def modules_in(tree: Any) -> list[torch.nn.Module]:
    """The modules in a state tree (containers only; not inside Stateful objects), in order."""
    found: list[torch.nn.Module] = []

    def walk(x: Any, depth: int) -> None:
        if depth > codec.MAX_DEPTH:
            return
        if isinstance(x, torch.nn.Module):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, depth + 1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, depth + 1)

    walk(tree, 0)
    return found


class Names:
    """Canonical parameter names for the optimizers of one state tree."""

    def __init__(self, tree: Any) -> None:
        self._modules = modules_in(tree)
        self._by_module: dict[int, dict[int, str]] = {}

    def _param_names(self, m: torch.nn.Module) -> dict[int, str]:
        if id(m) not in self._by_module:
            named = list(m.named_parameters())
            ren = _renamer(m, [k for k, _ in named]) or {}
            self._by_module[id(m)] = {id(p): ren.get(k, k) for k, p in named}
        return self._by_module[id(m)]

    def fqns(self, opt: torch.optim.Optimizer) -> list[str] | None:
        """The canonical name of each of `opt`'s parameters, in state_dict() id order; None when
        no single module of the tree owns them all."""
        params = [p for group in opt.param_groups for p in group["params"]]
        for m in self._modules:
            names = self._param_names(m)
            if all(id(p) in names for p in params):
                out = [names[id(p)] for p in params]
                return out if len(set(out)) == len(out) else None
        return None


def state_of(obj: Any, names: Names, keep_vars: bool = False) -> Any:
    """What a Stateful object saves: its state dict under canonical names (see module doc).
    keep_vars: a module's own parameters and buffers rather than detached aliases (for a
    reader of their bytes only: detaching a DTensor costs tens of microseconds), where the
    module keeps nn.Module's state_dict()."""
    if (keep_vars and isinstance(obj, torch.nn.Module)
            and type(obj).state_dict is torch.nn.Module.state_dict):
        sd = obj.state_dict(keep_vars=True)
    else:
        sd = obj.state_dict()
    if isinstance(obj, torch.nn.Module) and isinstance(sd, dict):
        ren = _renamer(obj, list(sd))
        return sd if ren is None else type(sd)((ren[k], v) for k, v in sd.items())
    if isinstance(obj, torch.optim.Optimizer):
        fqns = names.fqns(obj)
        if fqns is not None and numbered(sd, len(fqns)):
            return _by_name(sd, fqns)
    return sd


def numbered(sd: Any, n: int) -> bool:
    """True for Optimizer.state_dict()'s own layout: param_groups numbering 0..n-1 in order
    and state keyed by those numbers (an optimizer with a state_dict() of its own keeps it)."""
    if not (isinstance(sd, dict) and isinstance(sd.get("state"), dict)
            and isinstance(sd.get("param_groups"), list)):
        return False
    ids = [i for g in sd["param_groups"] if isinstance(g, dict) for i in g.get("params", ())]
    return ids == list(range(n)) and all(k in range(n) for k in sd["state"])


def encode(state: Any, keep_vars: bool = False) -> codec.Encoded:
    """codec.encode(state) with modules and optimizers saved by name (see the module doc).
    keep_vars: modules give their parameters themselves (state_of), for a save, which only
    reads the tensors' bytes."""
    names = Names(state)
    return codec.encode(state, lambda obj: state_of(obj, names, keep_vars))


def _by_name(sd: dict, fqns: list[str]) -> dict:
    name = dict(enumerate(fqns))
    return {**sd, "state": {name[i]: s for i, s in sd["state"].items()},
            "param_groups": [{**g, "params": [name[i] for i in g["params"]]}
                             for g in sd["param_groups"]]}


def saved_param_keys(doc: Any) -> list[list[Any]] | None:
    """The ``params`` lists of a saved optimizer document's param_groups, or None."""
    items = codec.dict_items(doc) if isinstance(doc, dict) else None
    groups = dict(items or ()).get("param_groups")
    if not isinstance(groups, list):
        return None
    out = []
    for g in groups:
        gi = codec.dict_items(g) if isinstance(g, dict) else None
        params = dict(gi or ()).get("params")
        if not isinstance(params, list):
            return None
        out.append(params)
    return out


class OptimizerView:
    """An optimizer target seen by name: `live` is its state dict keyed by FQN with the groups in
    the saved order; `back(restored)` is the dict to pass to load_state_dict()."""

    def __init__(self, sd: dict, fqns: list[str], saved_groups: list[list[Any]]) -> None:
        self.fqns = fqns
        self._sd = sd
        by_name = _by_name(sd, fqns)
        live_sets = [frozenset(g["params"]) for g in by_name["param_groups"]]
        saved_sets = [frozenset(p) for p in saved_groups]
        self.problem: str | None = None
        if sorted(map(sorted, live_sets)) != sorted(map(sorted, saved_sets)):
            self.problem = _group_difference(saved_sets, live_sets)
            order = list(range(len(live_sets)))
        else:
            order = [live_sets.index(s) for s in saved_sets]
        self.live = {**by_name, "param_groups": [by_name["param_groups"][i] for i in order]}

    def unknown(self, saved_state_keys: Iterable[Any]) -> list[Any]:
        known = set(self.fqns)
        return [k for k in saved_state_keys if k not in known]

    def back(self, restored: dict) -> dict:
        ids = {f: i for i, f in enumerate(self.fqns)}
        by_set = {frozenset(g["params"]): g for g in restored["param_groups"]}
        groups = []
        for g in self._sd["param_groups"]:
            saved = by_set[frozenset(self.fqns[i] for i in g["params"])]
            groups.append({**saved, "params": list(g["params"])})
        return {**restored, "state": {ids[k]: v for k, v in restored["state"].items()},
                "param_groups": groups}


def _group_difference(saved: list[frozenset], live: list[frozenset]) -> str:
    all_saved, all_live = frozenset().union(*saved), frozenset().union(*live)
    if all_saved != all_live:
        only_s, only_l = sorted(all_saved - all_live), sorted(all_live - all_saved)
        parts = []
        if only_s:
            parts.append(f"parameters only in the checkpoint: {', '.join(only_s[:8])}")
        if only_l:
            parts.append(f"parameters only in the target: {', '.join(only_l[:8])}")
        return "; ".join(parts)
    return (f"the checkpoint groups the parameters into {len(saved)} param_groups, the target "
            f"optimizer differently ({len(live)} groups)")


class ModuleView:
    """A module target seen under canonical names; `back(restored)` maps keys back."""

    def __init__(self, module: torch.nn.Module, sd: Any) -> None:
        self.raw = sd
        ren = _renamer(module, list(sd)) if isinstance(sd, dict) else None
        self._back = {v: k for k, v in ren.items()} if ren else None
        self.live = sd if ren is None else type(sd)((ren[k], v) for k, v in sd.items())

    def back(self, restored: Any) -> Any:
        if self._back is None or not isinstance(restored, dict):
            return restored
        return type(restored)((self._back.get(k, k), v) for k, v in restored.items())


def is_positional_optimizer_dict(t: Any) -> bool:
    """True for an ``Optimizer.state_dict()`` taken by hand (parameters numbered by position)."""
    groups = t.get("param_groups") if isinstance(t, dict) and "state" in t else None
    return isinstance(groups, list) and all(
        isinstance(g, dict) and isinstance(g.get("params"), list)
        and all(isinstance(i, int) for i in g["params"]) for g in groups)


def positional_doc(doc: Any, t: dict) -> tuple[Any, str | None]:
    """A saved by-name optimizer document renumbered for the positional state dict `t`, pairing
    parameters group by group in order, as ``Optimizer.load_state_dict`` itself pairs them;
    (doc unchanged, None) when `doc` is not by name; (None, why) when the groups differ."""
    saved = saved_param_keys(doc)
    if saved is None or not any(isinstance(k, str) for g in saved for k in g):
        return doc, None
    ids = [g["params"] for g in t["param_groups"]]
    if [len(g) for g in saved] != [len(g) for g in ids]:
        return None, (f"the checkpoint's param_groups hold {[len(g) for g in saved]} parameters, "
                      f"the target's {[len(g) for g in ids]}")
    to_id = {f: i for names, numbers in zip(saved, ids) for f, i in zip(names, numbers)}

    def with_params(group: Any, numbers: list[int]) -> Any:
        items = codec.dict_items(group) or []
        return {codec.DICT: [[k, numbers if k == "params" else v] for k, v in items]}

    out = []
    for k, v in codec.dict_items(doc) or []:
        if k == "state" and isinstance(v, dict):
            v = {codec.DICT: [[to_id.get(sk, sk), sv] for sk, sv in codec.dict_items(v) or []]}
        elif k == "param_groups":
            v = [with_params(g, numbers) for g, numbers in zip(v, ids)]
        out.append([k, v])
    return {codec.DICT: out}, None


def canonical_doc(doc: Any) -> Any:
    """A saved module state dict with wrapper parts removed from its keys (a checkpoint written
    from a DDP or compiled module before names were canonical); unchanged when keys collide."""
    items = codec.dict_items(doc) if isinstance(doc, dict) else None
    if not items or not all(isinstance(k, str) for k, _ in items):
        return doc
    keys = [canonical_name(k) for k, _ in items]
    if keys == [k for k, _ in items] or len(set(keys)) != len(keys):
        return doc
    return {codec.DICT: [[k, v] for k, (_, v) in zip(keys, items)]}


__all__ = ["ModuleView", "Names", "OptimizerView", "canonical_doc", "canonical_name", "encode",
           "modules_in", "saved_param_keys", "state_of"]
