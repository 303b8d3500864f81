"""The load contract: match a saved state document against the caller's live state, report
every difference before anything is written, then put the restored values in place.

``plan_load(doc, target, check)`` walks the saved document and the target side by side and
returns a LoadPlan: the saved tensors to read (each into the target's own tensor, or into a new
one where the target has none), and the keys that are missing, unexpected or mismatched. Only
``LoadPlan.finish()``, called after every tensor was read, changes the target: it stores the
non-tensor values, fills containers, and calls ``load_state_dict()`` on Stateful objects.

Matching rules (docs/STATE.md):
- a Stateful object and its ``state_dict()`` are interchangeable on both sides: a saved object is
  its state dict; an object target is matched through its current ``state_dict()`` and then gets
  ``load_state_dict()`` with the restored dict;
- a non-empty dict matches key by key: a key only in the target is *missing*, a key only in the
  checkpoint *unexpected*; an empty dict (``{}``, a fresh optimizer's ``state``) is filled with
  everything saved at that place; ``None`` is replaced by whatever was saved;
- lists and tuples match item by item and must have the same length;
- a tensor or array target must be a saved tensor of the same dtype and shape (sharded
  checkpointers check global shapes and coverage in `check`), and writable in place;
- plain values (numbers, strings, bytes) are replaced by the saved plain value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from resilient.checkpoint import codec, views
from resilient.checkpoint.dtensor import is_dtensor, local_tensor, storage_ptr, why_not_local
from resilient.errors import IncompatibleCheckpointError

#: check(name, target tensor or None, path) -> None if the saved tensor `name` can be read into
#: the target (and registers the read), else why not.
Check = Callable[..., "str | None"]  # (name, live tensor or None, path, like=None)

_PLAIN = (bool, int, float, str, bytes, bytearray, np.generic)


def layout_mismatch(have: tuple[str, tuple], want: tuple[str, tuple],
                    source: str = "checkpoint", target: str = "the target") -> str | None:
    """For a Check: why a saved tensor of (dtype name, shape) `have` cannot be read into a
    target of `want`, or None when they are the same."""
    if have[0] == want[0] and tuple(have[1]) == tuple(want[1]):
        return None
    return (f"{source} has {have[0]}{list(have[1])}, {target} has {want[0]}{list(want[1])}")


@dataclass
class Issues:
    """Differences between a checkpoint and a target, by '/'-joined key path."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)

    def extend(self, other: Issues) -> None:
        self.missing += other.missing
        self.unexpected += other.unexpected
        self.mismatched += other.mismatched

    def error(self, what: str) -> IncompatibleCheckpointError:
        parts = []
        for label, keys in (("missing from the checkpoint", self.missing),
                            ("not in the target state", self.unexpected),
                            ("mismatched", self.mismatched)):
            if keys:
                shown = ", ".join(keys[:20]) + (f" ... ({len(keys)} in all)" if len(keys) > 20
                                                 else "")
                parts.append(f"{label}: {shown}")
        hint = ""
        top = [k for k in self.unexpected if "/" not in k]
        if top and not self.missing and not self.mismatched and len(top) == len(self.unexpected):
            hint = (f" (the checkpoint also holds the top-level entries {', '.join(top)}: to "
                    "load only the entries the target has, e.g. the model for evaluation, pass "
                    "subset=True, which stays strict within them; strict=False would also let "
                    "keys inside them go missing or mismatched)")
        elif self.unexpected and not self.missing:
            hint = (" (pass strict=False to load what matches; a fresh optimizer's state_dict() "
                    "has no state yet: pass the optimizer object itself)")
        elif self.missing and _same_but_wrappers(self.missing, self.unexpected):
            hint = (" (the keys differ only by wrapper prefixes such as DDP's 'module.' or "
                    "torch.compile's '_orig_mod.': load into the module object, which resilient "
                    "matches by its unwrapped parameter names)")
        return IncompatibleCheckpointError(
            f"{what} does not fit the target state; nothing was modified. " + "; ".join(parts)
            + hint, self.missing, self.unexpected, self.mismatched)


def _same_but_wrappers(missing: list[str], unexpected: list[str]) -> bool:
    def bare(keys: list[str]) -> set[tuple[str, str]]:
        return {(k.rpartition("/")[0], views.canonical_name(k.rpartition("/")[2])) for k in keys}

    return bool(unexpected) and bare(missing) == bare(unexpected)


def unwritable(t: Any) -> str | None:
    """Why the engine cannot write into tensor `t` in place, or None."""
    if isinstance(t, np.ndarray):
        return None if t.flags.writeable else "a read-only numpy array"
    if is_dtensor(t):
        why = why_not_local(t)
        return why if why is not None else unwritable(local_tensor(t))
    if t.layout != torch.strided:
        return f"a {t.layout} tensor"
    if t.device.type == "meta":
        return ("on the meta device (no storage); materialize it first, e.g. "
                "module.to_empty(device=...)")
    if t.device.type not in ("cpu", "cuda"):
        return f"on {t.device}, which the engine cannot write"
    if t.numel() and t.data_ptr() == 0:
        return "a tensor without storage"
    return None


class LoadPlan:
    """What a load will do; nothing in the target changed yet. See the module docstring."""

    def __init__(self) -> None:
        self.issues = Issues()
        self.new: dict[str, str] = {}  # saved tensor name -> path, read into new tensors
        self._finish: Callable[[], Any] | None = None
        self._tensors: dict[str, Any] = {}

    def finish(self, tensors: dict[str, Any]) -> Any:
        """Puts the restored values in place; `tensors` holds the new tensors by saved name.
        Returns the restored state (the target itself where it could be updated in place)."""
        self._tensors = tensors
        return self._finish() if self._finish is not None else None


def entries(doc: Any, keys: list[Any]) -> Any:
    """The saved document restricted to the top-level entries `keys` (load(subset=True)):
    what is not in `keys` is neither read nor reported as unexpected; a key of `keys` that was
    not saved stays, so that the match reports it missing."""
    doc = codec.unwrap(doc)
    if not isinstance(doc, dict):
        raise IncompatibleCheckpointError(
            "load(subset=True): the checkpoint's state is not a dict of entries, so it has no "
            "top-level entries to choose from; load it whole")
    tag = codec.tag_of(doc)
    wanted = {codec.hashable(k) for k in keys}
    if tag is None:
        return {k: v for k, v in doc.items() if k in wanted}
    codec.dict_items(doc)  # well-formed pairs
    return {tag: [[k, v] for k, v in doc[tag]
                  if codec.decode_key(k) in wanted]}


def plan_load(doc: Any, target: Any, check: Check, root_path: str = "") -> LoadPlan:
    """Matches saved `doc` against `target` (see the module docstring). Never modifies `target`
    (it calls ``state_dict()`` of Stateful objects). Raises ValueError for a malformed doc."""
    plan = LoadPlan()
    issues = plan.issues

    def join(path: str, key: Any) -> str:
        k = codec.key_str(key)
        return f"{path}/{k}" if path else k

    # A fresh optimizer has no state to read into: its saved state tensors are created like
    # their parameter (a DTensor for a sharded one, on its device) where the shapes agree.
    protos: dict[str, torch.Tensor] = {}

    def fill(d: Any, path: str) -> Callable[[], Any]:
        for name in codec.tensor_refs(d):
            like = protos.get(name.rsplit("/", 1)[0]) if "/" in name else None
            why = check(name, None, path) if like is None else check(name, None, path, like=like)
            if why is not None:
                issues.mismatched.append(f"'{path}': {why}" if path else f"<root>: {why}")
            plan.new[name] = path

        def tensor_for(kind: str, name: str) -> Any:
            return plan._tensors[name]

        return lambda: codec.decode(d, tensor_for)

    names = views.Names(target)

    def optimizer_view(t: torch.optim.Optimizer, live: dict, d: Any,
                       path: str) -> views.OptimizerView | bool | None:
        """The optimizer seen by parameter name when the checkpoint keys it so (False: keyed
        by position, as Optimizer.state_dict(); None: cannot match, issue recorded)."""
        state_path = join(path, "state")
        saved_groups = views.saved_param_keys(d)
        if saved_groups is None or not any(isinstance(k, str) for g in saved_groups for k in g):
            protos.update(_parameter_slots(t, state_path))
            return False
        where = f"'{path}'" if path else "<root>"
        fqns = names.fqns(t)
        if fqns is None:
            issues.mismatched.append(
                f"{where}: the checkpoint keys this optimizer's state by parameter name, and the "
                "target state holds no module that owns all of its parameters; load the model "
                "and its optimizer together, e.g. {'model': model, 'optim': optim}")
            return None
        if not views.numbered(live, len(fqns)):
            issues.mismatched.append(
                f"{where}: the checkpoint keys this optimizer's state by parameter name, and its "
                "state_dict() is not Optimizer.state_dict()'s numbered layout")
            return None
        ov = views.OptimizerView(live, fqns, saved_groups)
        if ov.problem is not None:
            issues.mismatched.append(f"'{join(path, 'param_groups')}': {ov.problem}")
            return None
        saved_state = dict(codec.dict_items(d) or ()).get("state")
        items = codec.dict_items(saved_state) if isinstance(saved_state, dict) else None
        unknown = ov.unknown(k for k, _ in items or ())
        if unknown:
            issues.unexpected.extend(join(state_path, k) for k in unknown)
            return None
        params = [p for group in t.param_groups for p in group["params"]]
        protos.update({join(state_path, f): p for f, p in zip(fqns, params)})
        return ov

    def walk(d: Any, t: Any, path: str, depth: int) -> Callable[[], Any] | None:
        if depth > codec.MAX_DEPTH:
            raise ValueError(f"malformed checkpoint values: nested deeper than {codec.MAX_DEPTH}")
        d = codec.unwrap(d)
        if t is None:
            return fill(d, path)
        where = f"'{path}'" if path else "<root>"
        tag = codec.tag_of(d) if isinstance(d, dict) else None
        if isinstance(t, (torch.Tensor, np.ndarray)):
            if tag not in (codec.TENSOR, codec.NDARRAY):
                issues.mismatched.append(f"{where}: the checkpoint has {_kind(d)}, the target a "
                                         "tensor")
                return None
            why = unwritable(t)
            live = t if isinstance(t, torch.Tensor) else torch.from_numpy(t)
            why = why or check(d[tag], live, path)
            if why is not None:
                issues.mismatched.append(f"{where}: {why}")
                return None
            return lambda: t
        if codec.is_stateful(t):
            live = t.state_dict()
            back: Callable[[Any], Any] = lambda restored: restored  # noqa: E731
            if isinstance(t, torch.nn.Module):
                mv = views.ModuleView(t, live)
                live, back, d = mv.live, mv.back, _module_doc(d, mv.live)
            elif isinstance(t, torch.optim.Optimizer):
                ov = optimizer_view(t, live, d, path)
                if ov is None:
                    return None
                if ov is not False:
                    live, back = ov.live, ov.back
            inner = walk(d, live, path, depth + 1)
            if inner is None:
                return None

            def restore_object() -> Any:
                restored = inner()
                if not (isinstance(t, torch.nn.Module) and _all_in_place(t, restored, live)):
                    t.load_state_dict(back(restored))
                return t

            return restore_object
        if isinstance(t, dict):
            if views.is_positional_optimizer_dict(t):  # o.state_dict() taken by hand
                d, why = views.positional_doc(d, t)
                if why is not None:
                    issues.mismatched.append(f"'{join(path, 'param_groups')}': {why}")
                    return None
            items = codec.dict_items(d) if isinstance(d, dict) else None
            if items is None:
                issues.mismatched.append(f"{where}: the checkpoint has {_kind(d)}, the target "
                                         "a dict")
                return None
            saved = dict(items)
            if not t:  # an empty dict takes everything saved here
                parts = {k: fill(v, join(path, k)) for k, v in items}
            else:
                parts = {}
                for k in t:
                    if k in saved:
                        part = walk(saved[k], t[k], join(path, k), depth + 1)
                        if part is not None:
                            parts[k] = part
                    else:
                        issues.missing.append(join(path, k))
                issues.unexpected += [join(path, k) for k in saved if k not in t]

            def restore_dict() -> Any:
                for k, part in parts.items():
                    value = part()
                    if k not in t or t[k] is not value:
                        t[k] = value
                return t

            return restore_dict
        if isinstance(t, (list, tuple)):
            want = "list" if isinstance(t, list) else "tuple"
            seq = _sequence(d, want)
            if seq is None:
                issues.mismatched.append(f"{where}: the checkpoint has {_kind(d)}, the target a "
                                         f"{want}")
                return None
            if len(seq) != len(t):
                issues.mismatched.append(f"{where}: the checkpoint has {len(seq)} items, the "
                                         f"target {len(t)}")
                return None
            fields = getattr(type(t), "_fields", None)
            keys = fields if isinstance(fields, tuple) else range(len(t))
            parts_l = [walk(v, x, join(path, k), depth + 1) for v, x, k in zip(seq, t, keys)]

            def restore_seq() -> Any:
                values = [x if part is None else part() for part, x in zip(parts_l, t)]
                if isinstance(t, list):
                    t[:] = values
                    return t
                return type(t)(*values) if isinstance(fields, tuple) else type(t)(values)

            return restore_seq
        if isinstance(t, _PLAIN):
            if _kind(d) not in ("a value", "None"):
                issues.mismatched.append(f"{where}: the checkpoint has {_kind(d)}, the target "
                                         f"a {type(t).__name__}")
                return None
            return fill(d, path)
        issues.mismatched.append(f"{where}: cannot load into a {type(t).__name__} (no "
                                 "state_dict()/load_state_dict())")
        return None

    if isinstance(target, tuple):  # nothing could put a new tuple where the caller holds it
        issues.mismatched.append(f"{root_path or '<root>'}: a tuple cannot be restored in place; "
                                 "pass a dict or a list")
        return plan
    plan._finish = walk(doc, target, root_path, 0)
    return plan


def _module_doc(d: Any, live: Any) -> Any:
    """The saved module state `d`, its keys made canonical when only that makes them match the
    target's (a checkpoint written from a DDP or compiled module by an older version)."""
    items = codec.dict_items(d) if isinstance(d, dict) else None
    if items is None or not isinstance(live, dict) or {k for k, _ in items} == set(live):
        return d
    alt = views.canonical_doc(d)
    if alt is not d and {k for k, _ in codec.dict_items(alt) or ()} == set(live):
        return alt
    return d


def _all_in_place(module: torch.nn.Module, restored: Any, live: Any) -> bool:
    """True when a module's restored state dict is its live one and every tensor in it shares
    memory with one of the module's own parameters or buffers, so load_state_dict() would only
    copy each tensor onto itself. A state_dict() that hands out copies (FSDP1's full state
    dict, an override, a hook) gets load_state_dict()."""
    if restored is not live or not isinstance(live, dict):
        return False
    own = {storage_ptr(t) for t in (*module.parameters(), *module.buffers())}
    return all(isinstance(v, torch.Tensor) and (v.numel() == 0 or storage_ptr(v) in own)
               for v in live.values())


def _parameter_slots(opt: torch.optim.Optimizer, state_path: str) -> dict[str, torch.Tensor]:
    """'<state_path>/<id>' -> the parameter whose state is saved under that id (ids count the
    parameters of every group in order, as Optimizer.state_dict() numbers them)."""
    params = (p for group in opt.param_groups for p in group["params"])
    return {f"{state_path}/{i}": p for i, p in enumerate(params)}


def _sequence(d: Any, want: str) -> list | None:
    if isinstance(d, list):
        return d if want == "list" else None
    if isinstance(d, dict) and len(d) == 1:
        if codec.TUPLE in d and isinstance(d[codec.TUPLE], list):
            return d[codec.TUPLE] if want == "tuple" else None
        if codec.NAMEDTUPLE in d and isinstance(d[codec.NAMEDTUPLE], dict):
            values = d[codec.NAMEDTUPLE].get("values")
            return values if want == "tuple" and isinstance(values, list) else None
    return None


def _kind(d: Any) -> str:
    if d is None:
        return "None"
    if isinstance(d, list):
        return "a list"
    if isinstance(d, dict):
        tag = codec.tag_of(d)
        return {None: "a dict", codec.DICT: "a dict", codec.ODICT: "a dict",
                codec.TENSOR: "a tensor", codec.NDARRAY: "an array", codec.TUPLE: "a tuple",
                codec.NAMEDTUPLE: "a tuple"}.get(tag, "a value")
    return "a value"
