"""How the RNG checkpoint's cost per rank grows with the world size: format 2 against format 1.

At 1, 2, 4 and 8 gloo CPU ranks, each rank holds what a TP run holds: its own CPU generator
(seeded per rank, as accelerate's ``set_seed(s, device_specific=True)`` does), a stream equal on
every rank (``data-parallel-rng``), two per-rank streams (``model-parallel-rng``,
``expert-parallel-rng``) and a keyed RNG with 64 sites. For ``RNGStateful`` through
``dcp.save``/``dcp.load`` on the saved layout, and for the baseline in the same run - format 1,
the previous release's state dict: every rank's states all-gathered into one blob on every rank -
it prints per rank (the largest over ranks):

- held: bytes of the state dict the rank hands to DCP;
- sent / recv: bytes of the tensors of our own collectives in one save and one load (an
  all-reduce of n bytes counts 2n each way, a ring's bound; the baseline's all-gathers, at the
  save and again for the load's template, count what each rank sends and receives);
- wrote: bytes of the rank's own DCP data file (``__<rank>_0.distcp``);
- read: bytes of the entries the rank's load asks DCP for;
- ours ms: median time of our own ``state_dict()`` and ``load_state_dict()`` calls in one save
  and one load (our collectives included);
- save / load ms: median wall time of ``--repeats`` whole ``dcp.save``/``dcp.load`` calls (DCP's
  own planning, which gathers every rank's plan on rank 0, included). With more ranks than cores
  (8 on this 2-core machine) every wall time also grows with the oversubscription.

DCP's own ``.metadata`` (written by rank 0, read by every rank at load) lists every key, so it
grows with the world in both formats; it is printed separately. Then a least-squares line through
the 2-8 rank figures extrapolates each to 16,384 ranks, and the ratios 8 ranks / 2 ranks are
checked against the goal (flat within 25 %). Last, the bytes of the forms for trainers that write
from one process (``saved_by="main_process"``: gathered to rank 0) and from each node's local main
(``saved_by="each_node"``: all-gathered to every process), with the latter's growth extrapolated.

    python scripts/bench_rng_checkpoint.py [--worlds 1 2 4 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
from _scale import TARGET_WORLD, fit

_SITES = 64
_FIELDS = ("held", "sent", "recv", "wrote", "read", "ours_ms", "save_ms", "load_ms")
_EACH_NODE = ("held", "sent", "recv")


class _Format1:
    """The previous release's RNGStateful.state_dict(): every rank's states in one blob on every
    rank (an all-gather of each rank's bytes, then torch.save), loaded by unpickling the blob."""

    def __init__(self, tracker, keyed, counts) -> None:
        self.tracker, self.keyed, self.counts = tracker, keyed, counts

    def state_dict(self) -> dict:
        start = time.perf_counter()
        out = self._state_dict()
        self.counts["ours"] += time.perf_counter() - start
        return out

    def _state_dict(self) -> dict:
        import torch.distributed as dist

        from rng_tracker._collective import _encode_tree, all_gather_tensor_tree

        mine = {"cpu": torch.get_rng_state(), "tracker": self.tracker.state_dict()}
        world = dist.get_world_size()
        nbytes = len(_encode_tree(mine))
        self.counts["sent"] += nbytes * (world - 1)  # every rank's bytes to every other rank
        self.counts["recv"] += nbytes * (world - 1)
        everyone = all_gather_tensor_tree(mine) if world > 1 else [mine]
        payload = {
            "format": 1,
            "world": world,
            "layout": "",
            "ranks": dict(enumerate(everyone)),
            "keyed": self.keyed.state_dict(),
        }
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        return {"blob": buffer.getvalue()}

    def load_state_dict(self, state_dict: dict) -> None:
        import torch.distributed as dist

        start = time.perf_counter()
        self.counts["read"] = len(state_dict["blob"])
        payload = torch.load(io.BytesIO(state_dict["blob"]), weights_only=True)
        torch.set_rng_state(payload["ranks"][dist.get_rank()]["cpu"])
        self.counts["ours"] += time.perf_counter() - start


def _counting(base: type, counts: dict) -> type:
    """``base`` (RNGStateful) timing its own calls and noting the bytes its load is given."""

    class Counting(base):
        def state_dict(self):
            start = time.perf_counter()
            out = super().state_dict()
            counts["ours"] += time.perf_counter() - start
            return out

        def load_state_dict(self, state_dict):
            start = time.perf_counter()
            counts["read"] = sum(len(v) for v in state_dict.values())
            super().load_state_dict(state_dict)
            counts["ours"] += time.perf_counter() - start

    return Counting


def _setup():
    import torch.distributed as dist

    from rng_tracker._keyed import KeyedRNG
    from rng_tracker._tracker import RNGStatesTracker

    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)
    tracker = RNGStatesTracker("cpu")
    tracker.add("data-parallel-rng", 7)
    tracker.add("model-parallel-rng", 1000 + rank)
    tracker.add("expert-parallel-rng", 100000 + rank)
    keyed = KeyedRNG("cpu", seed=1234)
    for site in range(_SITES):
        keyed.register(f"layers.{site}.dropout")
    keyed.set_step(100)
    return tracker, keyed


def _measure(repeats: int, root: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from rng_tracker import dcp as rng_dcp

    warnings.filterwarnings("ignore")  # DCP's notes on its own planner; not ours to print
    rank = dist.get_rank()
    tracker, keyed = _setup()
    out = {}
    for name in ("format 1 (baseline)", "format 2"):
        counts = {"sent": 0, "recv": 0, "read": 0, "ours": 0.0}
        path = os.path.join(root, name.split()[1])
        if name.startswith("format 1"):
            stateful = _Format1(tracker, keyed, counts)
        else:
            stateful = _counting(rng_dcp.RNGStateful, counts)(tracker, keyed)
        saves, loads, ours = [], [], []
        for _ in range(repeats):
            before = rng_dcp.comm_bytes()
            counts["ours"] = 0.0
            dist.barrier()
            start = time.perf_counter()
            dcp.save({"rng": stateful}, checkpoint_id=path)
            saves.append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            dcp.load({"rng": stateful}, checkpoint_id=path)
            loads.append(time.perf_counter() - start)
            ours.append(counts["ours"])
            after = rng_dcp.comm_bytes()
            if name == "format 2":
                counts["sent"] = after["sent"] - before["sent"]
                counts["recv"] = after["received"] - before["received"]
        if name.startswith("format 1"):  # counted in every save and load (it gathers at both)
            counts["sent"] //= repeats
            counts["recv"] //= repeats
        held = stateful.state_dict() if name.startswith("format 1") else None
        if held is None:
            held = _held_under_dcp(stateful, os.path.join(root, "probe"))
        out[name] = {
            "held": sum(len(v) for v in held.values()),
            "sent": counts["sent"],
            "recv": counts["recv"],
            "wrote": os.path.getsize(os.path.join(path, f"__{rank}_0.distcp")),
            "read": counts["read"],
            "ours_ms": 1000 * statistics.median(ours),
            "save_ms": 1000 * statistics.median(saves),
            "load_ms": 1000 * statistics.median(loads),
            "metadata": os.path.getsize(os.path.join(path, ".metadata")),
        }
    # the forms for trainers that write from one process (accelerate's save_state: the main
    # process; with save_on_each_node=True, each node's local main): gathered to rank 0, or
    # all-gathered to every process
    for name, saved_by in (("main process", "main_process"), ("each node", "each_node")):
        before = rng_dcp.comm_bytes()
        held = rng_dcp.RNGStateful(tracker, keyed, saved_by=saved_by).state_dict()
        after = rng_dcp.comm_bytes()
        out[name] = {
            "held": sum(len(v) for v in held.values()),
            "sent": after["sent"] - before["sent"],
            "recv": after["received"] - before["received"],
            "rank": rank,
        }
    return out


def _held_under_dcp(stateful, path: str) -> dict:
    """What the RNGStateful hands DCP inside dcp.save (recorded through a subclass call)."""
    import torch.distributed.checkpoint as dcp

    seen = {}
    original = type(stateful).state_dict

    class Recording(type(stateful)):
        def state_dict(self):
            seen.update(original(self))
            return seen

    recording = Recording(stateful.tracker, stateful.keyed)
    dcp.save({"rng": recording}, checkpoint_id=path)
    return seen


def _main_read_back_at_scale(entry: int) -> tuple[float, float]:
    """Seconds rank 0 of the main-process form spends turning 16,384 gathered entries of
    ``entry`` bytes into bytes: by the previous read-back (tolist), and by the library's."""
    from rng_tracker._collective import as_bytes

    parts = [torch.randint(0, 256, (entry,), dtype=torch.uint8) for _ in range(TARGET_WORLD)]
    start = time.perf_counter()
    before = [bytes(part.tolist()) for part in parts]
    middle = time.perf_counter()
    now = [as_bytes(part) for part in parts]
    end = time.perf_counter()
    if before != now:
        raise AssertionError("the two read-backs disagree")
    return middle - start, end - middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from rng_tracker.parallel.testing import run_distributed

    rows: dict[str, dict[int, dict]] = {}
    main: dict[int, list[dict]] = {}
    each_node: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as root:
        for world in args.worlds:
            results = run_distributed(
                _measure,
                world_size=world,
                args=(args.repeats, os.path.join(root, str(world))),
                timeout=600,
            )
            for name in results[0]:
                if name == "main process":
                    main[world] = [r[name] for r in results]
                    continue
                if name == "each node":
                    each_node[world] = {f: max(r[name][f] for r in results) for f in _EACH_NODE}
                    continue
                merged = {f: max(r[name][f] for r in results) for f in (*_FIELDS, "metadata")}
                rows.setdefault(name, {})[world] = merged
    print(
        f"torch {torch.__version__}, gloo CPU ranks, {_SITES} keyed sites, 3 streams; "
        f"per rank = the largest over ranks; median of {args.repeats} saves/loads"
    )
    header = f"{'format':22}{'ranks':>6}" + "".join(f"{f:>10}" for f in _FIELDS)
    print(header + f"{'metadata':>10}")
    for name, by_world in rows.items():
        for world, row in by_world.items():
            cells = "".join(
                f"{row[f]:>10.1f}" if f.endswith("ms") else f"{int(row[f]):>10}" for f in _FIELDS
            )
            print(f"{name:22}{world:>6}{cells}{int(row['metadata']):>10}")
    print("\nmain-process form (saved_by='main_process', accelerate's save_state): bytes")
    print(
        f"{'ranks':>6}{'rank 0 held':>13}{'rank 0 recv':>13}{'others held':>13}{'others sent':>13}"
    )
    for world, per_rank in main.items():
        others = per_rank[1:] or [{"held": 0, "sent": 0}]
        print(
            f"{world:>6}{per_rank[0]['held']:>13}{per_rank[0]['recv']:>13}"
            f"{max(o['held'] for o in others):>13}{max(o['sent'] for o in others):>13}"
        )
    entry = max(o["sent"] for per_rank in main.values() for o in per_rank[1:] or [{"sent": 0}])
    if entry:
        before, now = _main_read_back_at_scale(entry)
        print(
            f"rank 0's read-back of {TARGET_WORLD} gathered entries of {entry} bytes, measured in "
            f"this process: before (tolist) {before:.2f} s, now (one copy each) {now:.2f} s"
        )
    print("\neach-node form (saved_by='each_node', accelerate's save_on_each_node=True): bytes")
    print(f"{'ranks':>6}" + "".join(f"{'every rank ' + f:>18}" for f in _EACH_NODE))
    for world, row in each_node.items():
        print(f"{world:>6}" + "".join(f"{row[f]:>18}" for f in _EACH_NODE))
    fitted = [w for w in args.worlds if w >= 2]
    if len(fitted) < 2:
        return
    for f in _EACH_NODE:
        base, slope = fit(fitted, [each_node[w][f] for w in fitted])
        print(
            f"  {f}: {slope:.0f} bytes per rank of the world, "
            f"{(base + slope * TARGET_WORLD) / 1e6:.0f} MB on every rank at {TARGET_WORLD} ranks"
        )
    print("\nleast-squares growth over 2-8 ranks, extrapolated to 16,384 ranks (bytes; ms)")
    print(f"{'format':22}{'field':>10}{'per rank':>12}{'at 16384':>16}{'8 / 2':>8}")
    verdict = True
    for name, by_world in rows.items():
        for f in (*_FIELDS, "metadata"):
            values = [by_world[w][f] for w in fitted]
            base, slope = fit(fitted, values)
            ratio = by_world[max(fitted)][f] / max(by_world[min(fitted)][f], 1e-9)
            print(
                f"{name:22}{f:>10}{slope:>12.1f}{base + slope * TARGET_WORLD:>16.0f}{ratio:>8.2f}"
            )
            if name == "format 2" and f in ("held", "sent", "recv", "wrote", "read"):
                verdict &= ratio <= 1.25
    old, new = rows["format 1 (baseline)"], rows["format 2"]
    top = max(args.worlds)
    print(
        f"\nat {top} ranks, format 2 / format 1: held {new[top]['held'] / old[top]['held']:.3f}, "
        f"sent {new[top]['sent'] / max(old[top]['sent'], 1):.3f}, "
        f"save time {new[top]['save_ms'] / old[top]['save_ms']:.2f}, "
        f"load time {new[top]['load_ms'] / old[top]['load_ms']:.2f}"
    )
    print(
        "goal (format 2's held/sent/recv/wrote/read flat within 25 % from 2 to 8 ranks): "
        + ("met" if verdict else "NOT met")
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
