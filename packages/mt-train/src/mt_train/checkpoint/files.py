"""On-disk checkpoint layout, atomic publication and integrity checks.

A checkpoint is a folder ``<dir>/step-<8 digits>`` holding::

    rank-<5 digits>.safetensors   one shard per rank (tensors named as in the manifest)
    rank-<5 digits>.json          that rank's sidecar: run id, sha256 and tensor names
    manifest.json                 written last, by rank 0 (see MANIFEST_KEYS)

Atomicity: every rank writes into ``<dir>/.tmp-step-<8 digits>`` (its sidecar last, renamed
into place so that it is never seen half-written); rank 0 waits for all sidecars of this run
(matching ``run_id``), writes ``manifest.json`` there, fsyncs, and
renames the folder to its final name. ``rename`` within one filesystem is atomic, so a
folder named ``step-*`` is always complete, and a save killed at any point leaves only a
``.tmp-*`` folder that loading ignores and the next run removes. Saving a step that already
has a checkpoint (after a rewind) first renames the old folder to ``.old-step-<8 digits>``,
then publishes, then deletes it; if the save dies between the two renames,
:func:`restore_replaced` (run before a resume looks for checkpoints) renames the old folder
back, so a step's checkpoint is never lost. Nothing is pickled:
tensors go through safetensors, everything else through JSON.

Integrity: :func:`verify_checkpoint` checks a folder completely before it is trusted for a
resume or a rewind from disk — the manifest parses and has every required key, and every
shard it lists exists with the recorded size and sha256. A rejected folder is renamed to
``rejected-step-<8 digits>`` (kept for inspection, never listed again), and the next older
checkpoint is tried (:func:`newest_valid_checkpoint`). Pruning to ``keep_last`` spares the
steps a caller protects (rewind's stable checkpoint and the newer ones).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step-(\d{8})$")
MANIFEST_KEYS = ("format", "step", "config", "data", "world_size", "parallel", "shards", "tensors")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-step-{step:08d}"


def old_dir(root: Path, step: int) -> Path:
    """Where a step's previous checkpoint waits while a new one replaces it."""
    return root / f".old-step-{step:08d}"


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_shard(folder: Path, rank: int, run_id: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write this rank's shard and then its sidecar (the sidecar marks the shard complete)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / shard_name(rank)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    sidecar = {
        "run_id": run_id,
        "rank": rank,
        "sha256": sha256_file(path),
        "bytes": path.stat().st_size,
        "tensors": sorted(tensors),
    }
    # Written under another name and renamed: rank 0 polls for the sidecar and must never
    # read it half-written.
    final = folder / f"rank-{rank:05d}.json"
    partial = final.with_name(f".tmp-{final.name}")
    _fsync_write(partial, json.dumps(sidecar, indent=1).encode())
    os.replace(partial, final)


def publish(
    root: Path,
    step: int,
    world_size: int,
    run_id: str,
    manifest: dict[str, Any],
    keep_last: int,
    timeout_s: float = 1800.0,
    protect: frozenset[int] = frozenset(),
) -> Path:
    """Rank 0: wait for every rank's sidecar, write the manifest, rename, prune old checkpoints
    (except the steps in ``protect``)."""
    folder = tmp_dir(root, step)
    deadline = time.monotonic() + timeout_s
    sidecars: dict[int, dict[str, Any]] = {}
    while len(sidecars) < world_size:
        for rank in range(world_size):
            path = folder / f"rank-{rank:05d}.json"
            if rank not in sidecars and path.is_file():
                data = json.loads(path.read_text())
                if data["run_id"] == run_id:
                    sidecars[rank] = data
        if len(sidecars) < world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(sidecars))
                raise TimeoutError(
                    f"checkpoint step {step}: ranks {missing} never finished writing"
                )
            time.sleep(0.05)
    shards = {}
    tensors: dict[str, str] = {}
    for rank, data in sorted(sidecars.items()):
        name = shard_name(rank)
        shards[name] = {"rank": rank, "sha256": data["sha256"], "bytes": data["bytes"]}
        for tensor in data["tensors"]:
            tensors.setdefault(tensor, name)
    full = {"format": FORMAT_VERSION, **manifest, "shards": shards, "tensors": tensors}
    missing_keys = [k for k in MANIFEST_KEYS if k not in full]
    if missing_keys:
        raise ValueError(f"checkpoint manifest lacks {missing_keys}")
    _fsync_write(
        folder / "manifest.json", (json.dumps(full, indent=1, sort_keys=True) + "\n").encode()
    )
    final = step_dir(root, step)
    replaced = old_dir(root, step)
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(folder, final)
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    shutil.rmtree(replaced, ignore_errors=True)
    for old in list_checkpoints(root)[:-keep_last]:
        if checkpoint_step(old) not in protect:
            shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_step(folder: Path) -> int:
    match = STEP_DIR.match(folder.name)
    if match is None:
        raise ValueError(f"{folder} is not a step-<8 digits> checkpoint folder")
    return int(match.group(1))


def verify_checkpoint(folder: Path) -> str | None:
    """Why ``folder`` cannot be trusted (one line), or None when it is complete and intact."""
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        return f"unreadable manifest: {err}"
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        return f"manifest lacks {missing}"
    for shard, info in sorted(manifest["shards"].items()):
        path = folder / shard
        if not path.is_file():
            return f"shard {shard} is missing"
        size = path.stat().st_size
        if size != info["bytes"]:
            return f"shard {shard} has {size} bytes, the manifest says {info['bytes']}"
        digest = sha256_file(path)
        if digest != info["sha256"]:
            return f"shard {shard} sha256 {digest[:12]}... != manifest {info['sha256'][:12]}..."
    return None


def quarantine(folder: Path) -> Path:
    """Rename a rejected checkpoint out of the way (``rejected-step-*``); returns the new path."""
    target = folder.with_name(f"rejected-{folder.name}")
    if target.exists():
        shutil.rmtree(target)
    os.rename(folder, target)
    return target


def newest_valid_checkpoint(root: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that :func:`verify_checkpoint` accepts, and the newer ones it
    rejected with their reasons (newest first)."""
    rejected = []
    for folder in reversed(list_checkpoints(root)):
        reason = verify_checkpoint(folder)
        if reason is None:
            return folder, rejected
        rejected.append((folder, reason))
    return None, rejected


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` so that a crash leaves the old or the new file whole."""
    tmp = path.with_name(f".tmp-{path.name}")
    _fsync_write(tmp, (json.dumps(obj, indent=1) + "\n").encode())
    os.replace(tmp, path)


def discard(root: Path, steps: list[int]) -> None:
    """Delete the checkpoints of ``steps`` (an abandoned timeline after a rewind)."""
    for step in steps:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints (``step-*`` folders with a manifest), oldest first."""
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "manifest.json").is_file()
    ]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def restore_replaced(root: Path) -> None:
    """Put back a replaced checkpoint whose replacement never got its name (an ``.old-*``
    folder without its ``step-*``: the save died between the two renames of :func:`publish`).
    Run before looking for the checkpoint to resume from."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        final = root / p.name.removeprefix(".old-")
        if p.name.startswith(".old-step-") and not final.exists():
            os.rename(p, final)


def remove_stale(root: Path) -> None:
    """Delete ``.tmp-*`` folders left by saves that were killed, and ``.old-*`` folders whose
    replacement is in place."""
    if not root.is_dir():
        return
    restore_replaced(root)
    for p in root.iterdir():
        if p.name.startswith((".tmp-step-", ".old-step-")):
            shutil.rmtree(p, ignore_errors=True)


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(folder)!r} is not a complete checkpoint (no manifest.json)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {folder} has format {manifest.get('format')!r}; this mt-train reads "
            f"format {FORMAT_VERSION}"
        )
    return manifest


class CheckpointReader:
    """Reads named tensors of a checkpoint, verifying each shard's sha256 on first use."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.manifest = read_manifest(folder)
        self._verified: set[str] = set()

    def names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self.manifest["tensors"] if n.startswith(prefix))

    def has(self, name: str) -> bool:
        return name in self.manifest["tensors"]

    def _shard(self, shard: str) -> Path:
        path = self.folder / shard
        if shard not in self._verified:
            expected = self.manifest["shards"][shard]["sha256"]
            actual = sha256_file(path)
            if actual != expected:
                raise ValueError(
                    f"checkpoint shard {path} is corrupt: sha256 {actual} != {expected}"
                )
            self._verified.add(shard)
        return path

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        by_shard: dict[str, list[str]] = {}
        for name in names:
            if name not in self.manifest["tensors"]:
                raise KeyError(f"checkpoint {self.folder} has no tensor {name!r}")
            by_shard.setdefault(self.manifest["tensors"][name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for shard, wanted in by_shard.items():
            with safe_open(str(self._shard(shard)), framework="pt") as f:
                for name in wanted:
                    out[name] = f.get_tensor(name)
        return out


def checkpoint_folder(path: Path) -> Path:
    """A checkpoint folder, or the newest one under a checkpoint root."""
    if (path / "manifest.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"{str(path)!r} is neither an mt checkpoint nor a folder of them")
    return latest
