"""How verify_rng_consistency's cost per rank grows with the world size, and what it is at 16,384.

verify all-gathers every rank's fingerprints (a JSON payload of a few hundred bytes), so what one
rank receives and reads grows with the world. At 1, 2, 4 and 8 gloo CPU ranks (tp=2 × dp, the
streams model_parallel_seed sets), per rank (the largest over ranks):

- payload: bytes of the rank's JSON;
- gathered: bytes the rank receives in verify's collectives (its own part included);
- verify ms: median wall time of --repeats verify_rng_consistency calls;
- gather ms, before / now: median time of the gather of that payload alone, by the previous
  all_gather_bytes (the baseline: one output tensor per rank, each read back with tolist) and by
  the library's (one flat output, read back in one copy).

A least-squares line through the 2-8 rank byte counts extrapolates them to 16,384 ranks. Times
on 8 ranks over 2 cores are mostly the oversubscription and are not extrapolated: one rank's own
work at 16,384 ranks is measured directly instead, in this process, on 16,384 payloads of the
same form (tp8 × pp8 × dp256, fingerprints equal and distinct as the policy says): reading the
gathered bytes back and parsing them (before: a tolist and a parse per rank; now: one copy and
one parse), checking the policy and writing the report's text.

    python scripts/bench_verify.py [--worlds 1 2 4 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import torch
import torch.distributed as dist
from _scale import TARGET_WORLD, fit

_FIELDS = ("payload", "gathered", "verify_ms", "before_ms", "now_ms")


def _gather_before(payload: bytes) -> list[bytes]:
    """The previous all_gather_bytes (the baseline): an output tensor per rank, each read back
    to the host with tolist."""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    world = dist.get_world_size()
    length = torch.tensor([data.numel()], dtype=torch.int64)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    sizes = [int(n) for n in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: data.numel()] = data
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return _read_before(parts, sizes)


def _read_before(parts: list[torch.Tensor], sizes: list[int]) -> list[bytes]:
    return [bytes(part[:n].tolist()) for part, n in zip(parts, sizes, strict=True)]


def _median_ms(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _measure(repeats: int) -> dict:
    from rng_tracker import model_parallel_seed
    from rng_tracker._collective import all_gather_bytes, as_bytes
    from rng_tracker.parallel import (
        destroy_model_parallel,
        init_model_parallel,
        verify_rng_consistency,
    )

    state = init_model_parallel(tensor=min(2, dist.get_world_size()))
    plan = model_parallel_seed(1234, layout=state)
    gathered, sent = [0], []
    library_gather = dist.all_gather_single

    def counted(output, input, group=None, async_op=False):
        gathered[0] += output.numel() * output.element_size()
        sent.append(input)
        return library_gather(output, input, group=group, async_op=async_op)

    dist.all_gather_single = counted  # this rank's process is fresh and ends after
    report = verify_rng_consistency(state, plan=plan)
    dist.all_gather_single = library_gather
    if not report.ok:
        raise AssertionError(str(report))
    payload = as_bytes(sent[-1]).rstrip(b"\0")  # the JSON, without the padding to the longest
    row = {
        "payload": len(payload),
        "gathered": gathered[0],
        "verify_ms": _median_ms(lambda: verify_rng_consistency(state, plan=plan), repeats),
        "before_ms": _median_ms(lambda: _gather_before(payload), repeats),
        "now_ms": _median_ms(lambda: all_gather_bytes(payload), repeats),
        "form": json.loads(payload),
    }
    destroy_model_parallel()
    return row


def _digest(*what: object) -> str:
    return hashlib.blake2b(repr(what).encode(), digest_size=8).hexdigest()


def _policy(kind: str, name: str) -> str:
    """The stream whose equal/distinct rule a generator or stream of the payload follows."""
    from rng_tracker._streams import DEFAULT_STREAM

    return DEFAULT_STREAM if kind == "generators" else name


def _payloads_at(form: dict, tp: int, pp: int, dp: int) -> list[bytes]:
    """verify's payload for every rank of a tp × pp × dp world, in ``form``'s keys, each stream's
    fingerprint a function of the rank's coordinates on the axes the policy gives it."""
    from rng_tracker._streams import stream_axes

    payloads = []
    for rank in range(tp * pp * dp):
        coords = dict.fromkeys(form["coords"], 0)
        coords.update(tp=rank % tp, pp=rank // tp % pp, dp=rank // (tp * pp))
        prints = {
            kind: {
                name: _digest(
                    kind, name, tuple(coords[a] for a in stream_axes(_policy(kind, name)))
                )
                for name in form[kind]
            }
            for kind in ("generators", "streams")
        }
        entry = {**form, "coords": coords, **prints}
        payloads.append(json.dumps(entry).encode())
    return payloads


def _one_rank_at_scale(form: dict, repeats: int) -> dict:
    """One rank's own work in verify at 16,384 ranks (tp8 × pp8 × dp256), timed in this
    process: the read-back of the gathered bytes, before and now, the check and the report."""
    from rng_tracker._collective import parse_each, unpad
    from rng_tracker.parallel._verify import _check

    payloads = _payloads_at(form, tp=8, pp=8, dp=TARGET_WORLD // 64)
    sizes = [len(p) for p in payloads]
    width = max(sizes)
    flat = torch.zeros(len(payloads), width, dtype=torch.uint8)
    for rank, payload in enumerate(payloads):
        flat[rank, : len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = list(flat)  # the baseline's list of per-rank outputs
    flat = flat.reshape(-1)

    def timed(call) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)

    if _read_before(parts, sizes) != unpad(flat, sizes) or unpad(flat, sizes) != payloads:
        raise AssertionError("the two read-backs disagree")
    everyone = [json.loads(p) for p in payloads]
    report = _check(everyone)
    if not report.ok:
        raise AssertionError("the synthetic world breaks the policy: " + "; ".join(report.problems))
    return {
        "gathered": len(flat),
        "before_ms": timed(lambda: [json.loads(p) for p in _read_before(parts, sizes)]),
        "now_ms": timed(lambda: parse_each(unpad(flat, sizes))),
        "check_ms": timed(lambda: _check(everyone)),
        "text_ms": timed(lambda: str(report)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from rng_tracker.parallel.testing import run_distributed

    rows, form = {}, None
    for world in args.worlds:
        results = run_distributed(_measure, world_size=world, args=(args.repeats,), timeout=600)
        rows[world] = {f: max(r[f] for r in results) for f in _FIELDS}
        form = results[-1]["form"]
    print(
        f"torch {torch.__version__}, gloo CPU ranks, tp=2 × dp; per rank = the largest over ranks;"
        f" median of {args.repeats} calls"
    )
    print(f"{'ranks':>6}" + "".join(f"{f:>12}" for f in _FIELDS))
    for world, row in rows.items():
        cells = "".join(
            f"{row[f]:>12.2f}" if f.endswith("ms") else f"{int(row[f]):>12}" for f in _FIELDS
        )
        print(f"{world:>6}{cells}")
    fitted = [w for w in args.worlds if w >= 2]
    if len(fitted) >= 2:
        print(f"\nleast-squares growth over {fitted[0]}-{fitted[-1]} ranks (bytes)")
        print(f"{'field':>12}{'per rank':>12}{'at ' + str(TARGET_WORLD):>16}")
        for f in ("payload", "gathered"):
            base, slope = fit(fitted, [rows[w][f] for w in fitted])
            print(f"{f:>12}{slope:>12.2f}{base + slope * TARGET_WORLD:>16.0f}")
        print(
            "(times are not extrapolated: with more ranks than cores they grow with the "
            "oversubscription; one rank's own work at scale is measured below)"
        )
    scale = _one_rank_at_scale(form, args.repeats)
    print(
        f"\none rank's own work at {TARGET_WORLD} ranks (tp8 × pp8 × dp256), measured in this "
        f"process on {scale['gathered']} gathered bytes:"
    )
    print(
        f"  read back and parse: before {scale['before_ms']:.1f} ms, now {scale['now_ms']:.1f} ms"
        f" (now / before {scale['now_ms'] / scale['before_ms']:.2f})"
    )
    print(
        f"  check the policy {scale['check_ms']:.1f} ms; the report's text {scale['text_ms']:.1f} ms"
    )


if __name__ == "__main__":
    main()
