"""`resilient ckpt`: list, inspect, verify, compare and convert checkpoints (docs/ckpt.md).

Exit status: 0 success; 1 the check found something (verify: corruption; diff: the steps
differ); 2 bad input, said in one line (a missing or foreign root, an unknown step, a bad
option, a source to import that is malformed or unsafe); 3 an internal error (a bug in
resilient: the traceback is printed). The work is done by resilient.checkpoint's catalog,
verify, diff and convert modules, imported when a command runs (ls, show and verify never
import torch); this one parses arguments and prints.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import traceback
from typing import Any, Callable

from resilient.errors import CorruptCheckpointError, ResilientError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("ckpt", help="list, inspect, verify, diff, export and import checkpoints",
                       description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = p.add_subparsers(dest="ckpt_command", required=True, metavar="COMMAND")

    def command(name: str, run: Callable[[argparse.Namespace], int], help: str,
                ) -> argparse.ArgumentParser:
        c = cmds.add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".")
        c.add_argument("--json", action="store_true", help="print one JSON document")
        c.add_argument("-q", "--quiet", action="store_true", help="no progress output")
        c.set_defaults(func=lambda args: _guarded(run, args))
        return c

    c = command("ls", _ls,
                "committed steps of a root: lineage, sizes, world size, mesh, sharding")
    c.add_argument("root", help="checkpoint root directory")
    c.add_argument("--verify", action="store_true", help="also re-check every chunk (reads "
                   "all data)")

    c = command("show", _show, "one step: lineage, world size, state outline, tensors")
    c.add_argument("root", help="checkpoint root directory")
    c.add_argument("--step", type=int, help="step (default: newest of the current lineage)")
    c.add_argument("--tensors", action="store_true", help="list every tensor")

    c = command("verify", _verify, "re-check lineage records, manifest seals, values and "
                "every chunk's checksum; exit 1 on corruption")
    c.add_argument("root", help="checkpoint root directory")
    c.add_argument("--step", type=int, help="only this step (default: every committed step)")

    c = command("diff", _diff, "compare two steps tensor by tensor; exit 1 if they differ")
    c.add_argument("root_a", help="first checkpoint root")
    c.add_argument("root_b", help="second checkpoint root (may be the same root)")
    c.add_argument("--step-a", type=int, help="step of root_a (default: newest)")
    c.add_argument("--step-b", type=int, help="step of root_b (default: newest)")
    c.add_argument("--all", action="store_true", help="also list equal tensors")

    c = command("export", _export, "write a step as safetensors, torch.save or DCP")
    c.add_argument("root", help="checkpoint root directory")
    c.add_argument("out", help="output: a directory (safetensors, dcp) or a file (torch)")
    c.add_argument("--format", required=True, choices=("safetensors", "torch", "dcp"),
                   help="output format")
    c.add_argument("--step", type=int, help="step (default: newest of the current lineage)")
    c.add_argument("--key", help="export only this state entry's state dict, with its own key "
                   "names (e.g. model: what load_state_dict / from_pretrained read)")
    c.add_argument("--max-shard-size", default="5GB", help="safetensors: split into files of "
                   "at most this size, with model.safetensors.index.json (default 5GB)")
    c.add_argument("--hf-config", metavar="PATH", help="safetensors: a Hugging Face config.json, "
                   "or a model directory whose config and tokenizer files are copied beside the "
                   "weights (makes OUT loadable by from_pretrained)")

    c = command("import", _import, "write a torch.save file, safetensors or DCP checkpoint as "
                "a step of a root")
    c.add_argument("src", help="a torch.save file, a .safetensors file or directory, or a DCP "
                   "directory")
    c.add_argument("root", help="checkpoint root (created if missing)")
    c.add_argument("--format", choices=("safetensors", "torch", "dcp"),
                   help="source format (default: detected)")
    c.add_argument("--step", type=int, help="step to write (default: the exported step, or 0)")
    c.add_argument("--key", help="store what SRC holds under this state entry (e.g. model, so "
                   "that load({'model': model}) restores it); resilient exports ignore it")
    c.add_argument("--as-head", action="store_true",
                   help="into a root that already has steps: make the imported step the newest "
                   "of its lineage (a job on that root then resumes from it); --step must be "
                   "greater than the root's newest step. Without it such a root is refused")


# -- plumbing ------------------------------------------------------------------------------
def _guarded(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Runs a command; user errors become one line on stderr and exit status 2 (1 for a
    corrupt checkpoint), never a traceback; anything else is a bug: its traceback and 3, so
    that 1 always means "corruption found"."""
    try:
        return run(args)
    except CorruptCheckpointError as e:
        _error(args, f"corrupt checkpoint: {e}")
        return 1
    except ImportError as e:
        _error(args, f"{e}; install it (pip install {e.name or 'safetensors'})")
        return 2
    except (ResilientError, OSError, ValueError, KeyError) as e:
        _error(args, str(e) if not isinstance(e, KeyError) else f"missing {e}")
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the last resort: say it is ours, with the trace
        traceback.print_exc()
        _error(args, f"internal error ({type(e).__name__}: {e}); please report it with the "
               "traceback above")
        return 3


def _error(args: argparse.Namespace, message: str) -> None:
    """The error on stderr; with --json also as {"error": ...} on stdout, for scripts."""
    print(f"resilient ckpt {args.ckpt_command}: error: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        _print_json({"error": message, "command": args.ckpt_command})


def _progress(args: argparse.Namespace) -> Callable[[int, int, str], None]:
    """Progress on stderr for long work: a tqdm bar when tqdm is installed, else one updated
    line; nothing with --quiet, --json or when stderr is not a terminal."""
    if args.quiet or args.json or not sys.stderr.isatty():
        return lambda done, total, what: None
    return make_progress(sys.stderr)


def make_progress(stream: Any) -> Callable[[int, int, str], None]:
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    bars: dict[str, Any] = {}

    def report(done: int, total: int, what: str) -> None:
        if tqdm is not None:
            bar = bars.get(what)
            if bar is None:
                # a terminal that reports no size (0 x 0: a bare pty) would hide the bar
                cols, rows = shutil.get_terminal_size((80, 24))
                bar = bars[what] = tqdm(total=total, desc=what, file=stream, leave=False,
                                        ncols=cols or 80, nrows=rows or 24)
            bar.update(done - bar.n)
            if done >= total:
                bar.close()
                del bars[what]
            return
        end = "\n" if done >= total else ""
        stream.write(f"\r{what}: {done}/{total}{end}")
        stream.flush()

    return report


def _print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2, default=_jsonable)
    print()


def _jsonable(obj: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if isinstance(obj, (bytes, bytearray)):
        return f"<{len(obj)} bytes>"
    return str(obj)


def size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(rows: list[list[str]], right: set[int]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        print("  ".join(cells).rstrip())


# -- commands ------------------------------------------------------------------------------
def _ls(args: argparse.Namespace) -> int:
    from resilient.checkpoint import catalog

    info = catalog.list_root(args.root, verify=args.verify, progress=_progress(args))
    if args.json:
        _print_json(info.to_dict())
        return 0
    head = "none" if info.head is None else f"step {info.head}"
    print(f"{info.root}: {len(info.steps)} committed step(s), head {head}"
          + (f", latest -> {info.latest_hint}" if info.latest_hint else ""))
    if info.steps:
        rows = [["STEP", "SEQ", "PARENT", "LINEAGE", "WORLD", "MESH", "TENSORS", "SHARDED",
                 "BYTES", "ON DISK", "VERIFIED", "TIERS"]]
        urls = [str(t.get("url")) for t in info.tiers]
        for s in info.steps:
            verified = {True: "yes", False: "NO", None: "-"}[s.verified]
            held = ",".join(["root", *(str(urls.index(u) + 1) for u in s.tiers if u in urls)])
            rows.append([str(s.step), _dash(s.seq), _dash(s.parent), s.lineage,
                         _dash(s.world_size), _dash(s.mesh), _dash(s.tensors), _dash(s.sharded),
                         size(s.bytes), size(s.stored_bytes), verified, held])
        _table(rows, {0, 1, 2, 4, 6, 7, 8, 9})
    for i, t in enumerate(info.tiers):
        state = (f"copying step {t.get('copying')}" if t.get("copying") is not None else
                 f"step {t.get('pending')} pending" if t.get("pending") is not None else
                 "up to date")
        error = f"; last error: {t.get('error')}" if t.get("error") else ""
        print(f"tier {i + 1}: {t.get('url')} ({state}{error})")
    for s in info.steps:
        if s.error:
            print(f"step {s.step}: {s.error}")
    for name in info.in_progress:
        print(f"{name}: a save in progress (or left by a crash), never read")
    return 1 if any(s.verified is False for s in info.steps) else 0


def _dash(v: Any) -> str:
    return "-" if v is None else str(v)


def _show(args: argparse.Namespace) -> int:
    from resilient.checkpoint import catalog

    info = catalog.describe_step(args.root, args.step, tensors=args.tensors)
    if args.json:
        _print_json(info)
        return 0
    li = info["lineage"]
    lineage = (li if isinstance(li, str) else "not recorded" if li is None
               else f"seq {li['seq']}, parent step {_dash(li['parent_step'])}")
    print(f"{info['root']} step {info['step']}")
    print(f"  lineage     {lineage}")
    print(f"  world size  {info['world_size']} ({len(info['shards'])} shard file(s))")
    if info.get("mesh"):
        print(f"  mesh        {info['mesh']}")
    print(f"  tensors     {info['tensor_count']}, {size(info['bytes'])} "
          f"({size(info['stored_bytes'])} on disk)")
    print(f"  meta        {json.dumps(info['meta'], sort_keys=True)}")
    print("  state")
    _outline(info["state"], "    ")
    for r, doc in enumerate(info["rank_state"]):
        if doc is not None:
            print(f"  rank_state of rank {r}")
            _outline(doc, "    ")
    if args.tensors:
        rows = [["NAME", "DTYPE", "SHAPE", "BYTES", "PIECES", "GRID", "RANKS"]]
        for t in info["tensors"]:
            grid = "x".join(map(str, t["grid"])) if t["pieces"] > 1 else "-"
            rows.append([t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()",
                         size(t["nbytes"]), str(t["pieces"]), grid,
                         ",".join(map(str, t["ranks"]))])
        print()
        _table(rows, {3, 4})
    return 0


def _outline(doc: Any, indent: str) -> None:
    if isinstance(doc, dict):
        for k, v in doc.items():
            print(f"{indent}{k}: {v}")
    else:
        print(f"{indent}{doc}")


def _verify(args: argparse.Namespace) -> int:
    from resilient.checkpoint import verify

    steps, problems = verify.verify_root(args.root, args.step, progress=_progress(args))
    if args.json:
        _print_json({"root": args.root, "steps": steps, "ok": not problems,
                     "problems": problems})
        return 1 if problems else 0
    bad = {p.step for p in problems}
    for p in problems:
        where = p.file + (f" at offset {p.offset}" if p.offset is not None else "")
        print(f"step {p.step}: CORRUPT: {where}: {p.message}")
    print(f"{len(steps) - len(bad)} of {len(steps)} step(s) verified"
          + (f"; corrupt: {', '.join(map(str, sorted(bad)))}" if bad else ""))
    return 1 if problems else 0


def _diff(args: argparse.Namespace) -> int:
    from resilient.checkpoint import diff

    d = diff.diff_steps(args.root_a, args.root_b, args.step_a, args.step_b,
                           progress=_progress(args))
    changed = [t for t in d["tensors"] if t.status != "equal"]
    if args.json:
        _print_json({**d, "equal": not changed and not d["values"]})
        return 1 if changed or d["values"] else 0
    print(f"a: {d['a']['root']} step {d['a']['step']}")
    print(f"b: {d['b']['root']} step {d['b']['step']}")
    shown = d["tensors"] if args.all else changed
    if shown:
        rows = [["TENSOR", "STATUS", "DIFFERING", "MAX ABS DIFF", "DETAIL"]]
        for t in shown:
            count = "-" if t.differing is None else f"{t.differing}/{t.numel}"
            mad = "-" if t.max_abs_diff is None else f"{t.max_abs_diff:.6g}"
            rows.append([t.name, t.status, count, mad, t.detail])
        _table(rows, {2, 3})
    for v in d["values"]:
        print(f"value {v['path']}: {v['a']!r} -> {v['b']!r}")
    equal = len(d["tensors"]) - len(changed)
    print(f"{equal} tensor(s) equal, {len(changed)} differ or are missing, "
          f"{len(d['values'])} other value(s) differ")
    return 1 if changed or d["values"] else 0


def _export(args: argparse.Namespace) -> int:
    from resilient.checkpoint import convert

    s = convert.export_checkpoint(args.root, args.out, args.format, args.step, args.key,
                                  args.max_shard_size, args.hf_config, _progress(args))
    if args.json:
        _print_json(s)
        return 0
    what = f"entry {args.key!r}" if args.key else "the whole state"
    print(f"exported step {s['step']} ({what}: {s['tensors']} tensors, {size(s['bytes'])}) "
          f"to {s['out']} as {s['format']}: {', '.join(s['files'])}")
    if s.get("hf_files"):
        print(f"copied {', '.join(s['hf_files'])}")
    if s["skipped"]:
        print(f"skipped non-tensor values: {', '.join(s['skipped'])}")
    return 0


def _import(args: argparse.Namespace) -> int:
    from resilient.checkpoint import convert

    s = convert.import_checkpoint(args.src, args.root, args.step, args.key, args.format,
                                  _progress(args), as_head=args.as_head)
    if args.json:
        _print_json(s)
        return 0
    how = "rebuilt exactly from a resilient export" if s["exact"] else "as loaded"
    print(f"imported {s['src']} ({s['format']}, {s['tensors']} tensors, {how}) as step "
          f"{s['step']} of {s['root']}")
    if s["tied"]:
        print(f"added tied weights that the files leave out: {', '.join(s['tied'])}")
    if s["dropped_rank_states"]:
        print(f"note: per-rank state of {s['dropped_rank_states']} rank(s) beyond rank 0 "
              "was not imported (an import writes a one-rank checkpoint)")
    return 0
