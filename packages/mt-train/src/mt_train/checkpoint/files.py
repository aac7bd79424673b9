"""On-disk checkpoint layout, atomic publication and integrity checks.

A checkpoint is a folder ``<dir>/step-<8 digits>`` holding::

    rank-<5 digits>.safetensors   one shard per rank (tensors named as in the manifest)
    rank-<5 digits>.json          that rank's sidecar: run id, sha256 and tensor names
    manifest.json                 written last, by rank 0 (see MANIFEST_KEYS)

A rank whose tensors are too many for one file (``mt-convert import`` of a model of hundreds
of gigabytes, :class:`ShardWriter` with ``max_file_bytes``) writes them as parts
``rank-<5 digits>-part-<5 digits>.safetensors`` instead, and its sidecar lists each part's
sha256, size and tensor names under ``files``. The manifest was always a map of files
(``shards``: file name -> rank, sha256, bytes) and of tensors to their file (``tensors``), so
it holds parts as it holds ranks: its format (version 1) is unchanged, every reader reads
both layouts (older mt-train versions included), and a rank that fits one file is written
exactly as before.

Atomicity: every rank writes into ``<dir>/.tmp-step-<8 digits>`` (its sidecar last, renamed
into place so that it is never seen half-written); rank 0 waits for all sidecars of this run
(matching ``run_id``), writes ``manifest.json`` there, fsyncs it and the folder, renames the
folder to its final name and fsyncs the parent. ``rename`` within one filesystem is atomic,
so a folder named ``step-*`` is always complete, and a save killed at any point leaves only
a ``.tmp-*`` folder that loading ignores and the next run removes. Deleting goes the other
way: a pruned or discarded checkpoint is first renamed to ``.del-step-<8 digits>``, then
deleted, so a kill in the middle of a deletion never leaves a ``step-*`` folder without its
manifest (the next run removes ``.del-*`` folders too). Saving a step that already
has a checkpoint (after a rewind) first renames the old folder to ``.old-step-<8 digits>``,
then publishes, then deletes it; if the save dies between the two renames,
:func:`restore_replaced` (run before a resume looks for checkpoints) renames the old folder
back, so a step's checkpoint is never lost. Nothing is pickled:
tensors go through safetensors, everything else through JSON.

Integrity: :func:`verify_checkpoint` checks a folder completely before it is trusted for a
resume or a rewind from disk — the manifest parses, is an object with every required key of
the right type (:func:`manifest_problem`), and every shard it lists exists with the recorded
size and sha256. A rejected folder is renamed to
``rejected-step-<8 digits>`` (kept for inspection, never listed again), and the next older
checkpoint is tried (:func:`newest_valid_checkpoint`). Pruning to ``keep_last`` spares the
steps a caller protects (rewind's stable checkpoint and the newer ones).

Write sites and save phases are named fault points (:mod:`mt_train.fault_points`), so drills
can fill the disk or kill the process at each of them.
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
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mt_train import fault_points

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step-(\d{8})$")
MANIFEST_KEYS = ("format", "step", "config", "data", "world_size", "parallel", "shards", "tensors")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-step-{step:08d}"


def del_dir(root: Path, step: int) -> Path:
    """Where a checkpoint goes while it is being deleted."""
    return root / f".del-step-{step:08d}"


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


def fsync_dir(folder: Path) -> None:
    """Make ``folder``'s entries (files created or renamed in it) durable."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


OS_ERROR_CODE = re.compile(r"(?:os error |code: )(\d+)")


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``safetensors.torch.save_file`` (metadata ``format: pt``, as transformers writes),
    fsynced, its I/O failures raised as ``OSError`` (it reports a full disk as a
    ``SafetensorError`` naming the OS error code)."""
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    try:
        save_file(contiguous, str(path), metadata={"format": "pt"})
    except SafetensorError as err:
        code = OS_ERROR_CODE.search(str(err))
        if code is None:
            raise
        number = int(code.group(1))
        raise OSError(number, os.strerror(number), str(path)) from err
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def part_name(rank: int, part: int) -> str:
    """The ``part``-th file of a rank whose tensors :class:`ShardWriter` splits."""
    return f"rank-{rank:05d}-part-{part:05d}.safetensors"


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class ShardWriter:
    """One rank's tensors written as they are produced: :meth:`add` buffers them, and once the
    buffer holds ``max_file_bytes`` (None: no limit) it is written as the next part; :meth:`close`
    writes what is left and then the sidecar, which marks the rank's files complete. A rank
    whose tensors never reached the limit gets one file, ``rank-<5 digits>.safetensors``, and
    the sidecar :func:`write_shard` writes, byte for byte. Host memory holds the buffer (below
    ``max_file_bytes`` plus the last :meth:`add`), never the rank's whole state."""

    def __init__(
        self,
        folder: Path,
        rank: int,
        run_id: str,
        max_file_bytes: int | None = None,
        step: int | None = None,
    ) -> None:
        if max_file_bytes is not None and max_file_bytes < 1:
            raise ValueError(f"max_file_bytes={max_file_bytes}; valid: a positive size or None")
        self.folder, self.rank, self.run_id, self.step = folder, rank, run_id, step
        self.max_file_bytes = max_file_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffered = 0
        self._names: set[str] = set()
        self._parts: dict[str, dict[str, Any]] = {}
        folder.mkdir(parents=True, exist_ok=True)

    @property
    def names(self) -> set[str]:
        """Every tensor added so far."""
        return set(self._names)

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Buffer ``tensors`` (names new to this rank); write a part when the limit is reached."""
        twice = sorted(self._names & set(tensors))
        if twice:
            raise ValueError(f"tensors {twice[:3]} were already written to this shard")
        self._names.update(tensors)
        self._buffer.update(tensors)
        self._buffered += _nbytes(tensors)
        if self.max_file_bytes is not None and self._buffered >= self.max_file_bytes:
            self._flush(part_name(self.rank, len(self._parts)))

    def _flush(self, name: str) -> None:
        path = self.folder / name
        fault_points.disk_write("checkpoint", path, self.step)
        save_safetensors(self._buffer, path)
        self._parts[name] = {
            "sha256": sha256_file(path),
            "bytes": path.stat().st_size,
            "tensors": sorted(self._buffer),
        }
        self._buffer, self._buffered = {}, 0

    def close(self) -> None:
        """Write the buffered tensors and the sidecar (renamed into place: rank 0 polls for it
        and must never read it half-written)."""
        if not self._parts:
            self._flush(shard_name(self.rank))
            sidecar = {"run_id": self.run_id, "rank": self.rank, **self._parts.popitem()[1]}
        else:
            if self._buffer:
                self._flush(part_name(self.rank, len(self._parts)))
            sidecar = {"run_id": self.run_id, "rank": self.rank, "files": self._parts}
        final = self.folder / f"rank-{self.rank:05d}.json"
        partial = final.with_name(f".tmp-{final.name}")
        _fsync_write(partial, json.dumps(sidecar, indent=1).encode())
        os.replace(partial, final)


def write_shard(
    folder: Path,
    rank: int,
    run_id: str,
    tensors: dict[str, torch.Tensor],
    step: int | None = None,
) -> None:
    """Write this rank's shard and then its sidecar (the sidecar marks the shard complete);
    ``step``: the save's step (for the fault points)."""
    writer = ShardWriter(folder, rank, run_id, step=step)
    writer.add(tensors)
    writer.close()


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
        files = data.get("files") or {shard_name(rank): data}  # parts (ShardWriter) or one
        for name, info in sorted(files.items()):
            shards[name] = {"rank": rank, "sha256": info["sha256"], "bytes": info["bytes"]}
            for tensor in info["tensors"]:
                tensors.setdefault(tensor, name)
    full = {"format": FORMAT_VERSION, **manifest, "shards": shards, "tensors": tensors}
    missing_keys = [k for k in MANIFEST_KEYS if k not in full]
    if missing_keys:
        raise ValueError(f"checkpoint manifest lacks {missing_keys}")
    manifest_path = folder / "manifest.json"
    fault_points.disk_write("manifest", manifest_path, step)
    _fsync_write(manifest_path, (json.dumps(full, indent=1, sort_keys=True) + "\n").encode())
    fsync_dir(folder)
    fault_points.save_phase("manifest", step)
    final = step_dir(root, step)
    replaced = old_dir(root, step)
    fault_points.disk_write("publish", final, step)
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
        fault_points.save_phase("replace", step)
    os.rename(folder, final)
    fault_points.save_phase("publish", step)
    fsync_dir(root)
    shutil.rmtree(replaced, ignore_errors=True)
    for old in list_checkpoints(root)[:-keep_last]:
        if checkpoint_step(old) not in protect:
            delete_checkpoint(old, step)
    return final


def delete_checkpoint(folder: Path, saving: int | None = None) -> None:
    """Rename ``folder`` to ``.del-step-*``, then delete it (module docstring): a kill in
    between leaves no ``step-*`` folder without its manifest. ``saving``: the step whose save
    prunes it (a fault point)."""
    doomed = del_dir(folder.parent, checkpoint_step(folder))
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(folder, doomed)
    if saving is not None:
        fault_points.save_phase("prune", saving)
    shutil.rmtree(doomed, ignore_errors=True)


def checkpoint_step(folder: Path) -> int:
    match = STEP_DIR.match(folder.name)
    if match is None:
        raise ValueError(f"{folder} is not a step-<8 digits> checkpoint folder")
    return int(match.group(1))


SHARD_KEYS = {"rank": int, "sha256": str, "bytes": int}


def manifest_problem(manifest: Any, folder: Path | None = None) -> str | None:
    """What makes ``manifest`` (parsed JSON) unusable as a checkpoint manifest, or None: it
    must be an object with every key of :data:`MANIFEST_KEYS`, a ``step`` matching the
    folder's name, a non-empty ``shards`` object of ``{rank, sha256, bytes}`` entries and a
    non-empty ``tensors`` object naming listed shards."""
    if not isinstance(manifest, dict):
        return f"manifest is a JSON {type(manifest).__name__}, not an object"
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        return f"manifest lacks {missing}"
    step = manifest["step"]
    if not isinstance(step, int) or isinstance(step, bool):
        return f"manifest step is {step!r}, not an integer"
    if folder is not None and STEP_DIR.match(folder.name) and checkpoint_step(folder) != step:
        return f"manifest step {step} does not match the folder name {folder.name}"
    shards, tensors = manifest["shards"], manifest["tensors"]
    if not isinstance(shards, dict) or not shards:
        return f"manifest shards is {shards!r}, not a non-empty object"
    for name, info in shards.items():
        if not isinstance(info, dict) or any(
            not isinstance(info.get(k), t) for k, t in SHARD_KEYS.items()
        ):
            return f"manifest entry of shard {name!r} is {info!r}, not {{rank, sha256, bytes}}"
    if not isinstance(tensors, dict) or not tensors:
        return f"manifest tensors is {tensors!r}, not a non-empty object"
    strays = sorted({str(s) for s in tensors.values() if s not in shards})
    if strays:
        return f"manifest tensors name shards it does not list: {strays[:3]}"
    return None


def verify_checkpoint(folder: Path) -> str | None:
    """Why ``folder`` cannot be trusted (one line), or None when it is complete and intact."""
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        return f"unreadable manifest: {err}"
    problem = manifest_problem(manifest, folder)
    if problem is not None:
        return problem
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
    """The newest checkpoint that :func:`verify_checkpoint` accepts, and the newer ``step-*``
    folders it rejected with their reasons (newest first; a folder without a manifest too)."""
    rejected = []
    for folder in reversed(step_folders(root)):
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
        if step_dir(root, step).exists():
            delete_checkpoint(step_dir(root, step))


def step_folders(root: Path) -> list[Path]:
    """Every ``step-*`` folder, complete or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if STEP_DIR.match(p.name)), key=lambda p: p.name)


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
    """Delete ``.tmp-*`` folders left by saves that were killed, ``.old-*`` folders whose
    replacement is in place, and ``.del-*`` folders whose deletion was interrupted."""
    if not root.is_dir():
        return
    restore_replaced(root)
    for p in root.iterdir():
        if p.name.startswith((".tmp-step-", ".old-step-", ".del-step-")):
            shutil.rmtree(p, ignore_errors=True)


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(folder)!r} is not a complete checkpoint (no manifest.json)")
    manifest = json.loads(path.read_text())
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} holds a JSON {type(manifest).__name__}, not an object")
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
        problem = manifest_problem(self.manifest, folder)
        if problem is not None:
            raise ValueError(f"checkpoint {folder}: {problem}")
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
