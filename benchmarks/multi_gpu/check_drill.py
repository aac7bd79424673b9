"""Check a finished mt-train fault drill (``fault.nan_at_step=K`` with ``rewind=default``).

Reads the run folder that ``hydra.run.dir`` named and checks what "rewinds on both ranks and
completes" means in the files the trainer leaves:

* ``events.jsonl`` (written by rank 0, the agreed verdict of all ranks): one ``fault`` event
  (nan, step K), exactly one ``rewind`` with detector ``non_finite`` whose ``ranks`` name every
  rank (the NaN of one rank reaches all through the data-parallel loss mean), restored to a
  stable checkpoint before K;
* the last checkpoint is step ``--max-steps`` and holds a shard from every rank: each rank
  saves its own shard at the end, so every rank went through the rewind and trained on to the
  end in step with the others (a rank that had not rewound would be steps ahead, and its
  collectives would not have matched);
* ``metrics.jsonl``: the last training record is step ``--max-steps`` with a finite loss.

    python3 benchmarks/multi_gpu/check_drill.py RUN_DIR --max-steps 24 --fault-step 16 --world 2
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check(run: Path, max_steps: int, fault_step: int, world: int) -> list[tuple[str, bool, str]]:
    results: list[tuple[str, bool, str]] = []
    events = read_jsonl(run / "events.jsonl")
    faults = [e for e in events if e["event"] == "fault"]
    results.append(
        (
            "one nan fault at the step asked for",
            [(e["fault"], e["at_step"]) for e in faults] == [("nan", fault_step)],
            str([(e["fault"], e["at_step"], e.get("rank")) for e in faults]),
        )
    )
    rewinds = [e for e in events if e["event"] == "rewind"]
    results.append(("exactly one rewind", len(rewinds) == 1, f"{len(rewinds)} rewind event(s)"))
    if rewinds:
        r = rewinds[0]
        seen = r.get("ranks", {}).get("non_finite", [])
        results.append(
            (
                "detected as non_finite on every rank",
                r["detector"] == "non_finite" and seen == list(range(world)),
                f"detector {r['detector']}, ranks {seen}",
            )
        )
        restored = r.get("restored", {})
        results.append(
            (
                "restored a stable checkpoint before the fault",
                bool(restored.get("stable")) and restored.get("step", fault_step) < fault_step,
                f"step {restored.get('step')} from {restored.get('source')}",
            )
        )
    folders = sorted((run / "checkpoints").glob("step-*"))
    last = folders[-1] if folders else None
    shards = sorted(p.name for p in last.glob("rank-*.safetensors")) if last else []
    manifest = json.loads((last / "manifest.json").read_text()) if last else {}
    results.append(
        (
            "final checkpoint at max_steps with a shard from every rank",
            manifest.get("step") == max_steps
            and manifest.get("world_size") == world
            and len(shards) == world,
            f"{last.name if last else 'none'}: {len(shards)} shard(s), world {manifest.get('world_size')}",
        )
    )
    train = [m for m in read_jsonl(run / "metrics.jsonl") if m.get("kind") == "train"]
    final = train[-1] if train else {}
    results.append(
        (
            "training reached max_steps with a finite loss",
            final.get("step") == max_steps and math.isfinite(final.get("loss", math.nan)),
            f"last step {final.get('step')}, loss {final.get('loss')}",
        )
    )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--fault-step", type=int, required=True)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)
    results = check(args.run, args.max_steps, args.fault_step, args.world)
    print("| check | result | detail |\n| --- | --- | --- |")
    for name, ok, detail in results:
        print(f"| {name} | {'PASS' if ok else 'FAIL'} | {detail} |")
    passed = all(ok for _, ok, _ in results)
    print(f"\nfault drill: {'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
