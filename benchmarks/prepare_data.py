"""Throughput and peak memory of ``mt-prepare-data`` against a bare ``tokenizers`` loop.

For each corpus size a JSONL file of that many MB is generated on the fly (random words of a
fixed vocabulary, seeded; ~1 KB documents) in a temporary folder, and a byte-level BPE is
trained once on a small sample of it and saved as ``tokenizer.json`` (BPE training is not
measured). Then, side by side on the same cores:

* ``mt-prepare-data`` with that ``tokenizer.json`` and ``--workers`` processes, run as a
  subprocess;
* the bare loop, also a subprocess: read the file line by line, ``json.loads``, and
  ``Tokenizer.encode_batch`` on batches of ``--batch`` documents (the library's own threads,
  ``RAYON_NUM_THREADS`` = ``--workers`` of them), discarding the ids.

Each reports wall seconds, input MB/s and the peak resident memory of its whole process tree
(the sum of the proportional set sizes, ``Pss``, of the process and its children, polled from
``/proc``: pages a forked worker shares with its parent count once, as they occupy memory once), and the row
gives ``ratio = mt MB/s / bare MB/s``. Results print as JSON lines; ``--out`` writes them.

    python benchmarks/prepare_data.py --sizes-mb 256 1024 4096 --out prepare_data.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

PREPARE = "import sys; from mt_train.data.prepare import main; sys.exit(main())"
"""``mt-prepare-data`` as its console script runs it."""

BARE_LOOP = """
import json, sys
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
batch, size = [], int(sys.argv[3])
with open(sys.argv[2], "rb") as f:
    for line in f:
        batch.append(json.loads(line)["text"])
        if len(batch) == size:
            tok.encode_batch(batch)
            batch = []
if batch:
    tok.encode_batch(batch)
"""


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """``megabytes`` MB of JSONL documents of random words; returns the number of documents."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=n)) for n in rng.integers(2, 10, size=5000)]
    target, written, documents = int(megabytes * (1 << 20)), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            chunk = []
            for _ in range(1000):
                picks = rng.integers(0, len(words), size=170)
                line = json.dumps({"text": " ".join(words[i] for i in picks)}) + "\n"
                chunk.append(line)
            text = "".join(chunk)
            f.write(text)
            written += len(text)
            documents += len(chunk)
    return documents


def _memory(pid: int) -> int:
    """Proportional set size of ``pid`` in bytes (``Pss`` of ``smaps_rollup``: pages shared
    with forked workers count once over the tree), else its ``VmRSS``."""
    for path, key in ((f"/proc/{pid}/smaps_rollup", "Pss:"), (f"/proc/{pid}/status", "VmRSS:")):
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(key):
                        return int(line.split()[1]) * 1024
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return 0


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (0 once they are gone)."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        total += _memory(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def measure(
    command: list[str], poll_s: float = 0.05, env: dict[str, str] | None = None
) -> dict[str, float]:
    """Run ``command`` (with ``env`` added to this environment); its wall seconds and the peak
    RSS of its process tree."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    peak = 0

    def poll() -> None:
        nonlocal peak
        while proc.poll() is None:
            peak = max(peak, _tree_rss(proc.pid))
            time.sleep(poll_s)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    _, err = proc.communicate()
    seconds = time.perf_counter() - start
    watcher.join()
    if proc.returncode:
        raise RuntimeError(f"{command[:3]} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return {"seconds": seconds, "peak_rss_gb": peak / 1e9}


def run(
    sizes_mb: list[float],
    workers: int,
    batch: int,
    vocab_size: int,
    sample_mb: float = 2.0,
    out_json: Path | None = None,
) -> list[dict]:
    """One row per size, printed (and, with ``out_json``, the rows so far written there) as
    each size finishes, so a run stopped early keeps its smaller sizes."""
    from mt_train.data.tokenizer import train_bpe

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sample = folder / "sample.jsonl"
        write_corpus(sample, sample_mb, seed=1)
        with open(sample) as f:
            texts = [json.loads(line)["text"] for line in f]
        tokenizer = folder / "tokenizer.json"
        train_bpe(texts, vocab_size).tokenizer.save(str(tokenizer))  # type: ignore[attr-defined]
        for megabytes in sizes_mb:
            corpus = folder / f"corpus-{megabytes}.jsonl"
            documents = write_corpus(corpus, megabytes)
            size_mb = corpus.stat().st_size / 1e6
            # The same number of tokenizing threads as mt-prepare-data has worker processes.
            bare = measure(
                [sys.executable, "-c", BARE_LOOP, str(tokenizer), str(corpus), str(batch)],
                env={"RAYON_NUM_THREADS": str(workers)},
            )
            out = folder / "prepared"
            mt = measure([
                sys.executable, "-c", PREPARE, str(corpus), "--out", str(out),
                "--tokenizer", str(tokenizer), "--workers", str(workers), "--quiet",
            ])  # fmt: skip
            meta = json.loads((out / "meta.json").read_text())
            tokens = sum(s["tokens"] for s in meta["splits"].values())
            rows.append({
                "input_mb": round(size_mb, 1), "documents": documents, "tokens": tokens,
                "workers": workers,
                "mt_seconds": round(mt["seconds"], 2),
                "mt_mb_per_s": round(size_mb / mt["seconds"], 2),
                "mt_peak_rss_gb": round(mt["peak_rss_gb"], 3),
                "bare_seconds": round(bare["seconds"], 2),
                "bare_mb_per_s": round(size_mb / bare["seconds"], 2),
                "bare_peak_rss_gb": round(bare["peak_rss_gb"], 3),
                "ratio": round(bare["seconds"] / mt["seconds"], 3),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            if out_json is not None:
                out_json.write_text(json.dumps(rows, indent=2) + "\n")
            corpus.unlink()
            for name in os.listdir(out):
                (out / name).unlink()
            out.rmdir()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--batch", type=int, default=1000, help="documents per bare batch")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--sample-mb", type=float, default=2.0, help="BPE training sample")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    run(args.sizes_mb, args.workers, args.batch, args.vocab_size, args.sample_mb, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
