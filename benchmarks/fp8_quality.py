"""Training-quality runs: every FP8 recipe against bf16, and mt-train against plain PyTorch.

Workload (defaults): ``model=llama_125m`` (121,624,320 parameters: 14 layers, width 768, GQA 12:4,
FFN 3072, byte vocabulary padded to 320) on the bundled King James corpus, 2,000 optimizer steps
of 16 sequences × 256 tokens (no accumulation): 2,000 · 16 · 256 = 8,192,000 tokens, about 1.95
epochs of the 4,209,666-token training split (16,444 windows). AdamW at a peak LR of 6e-4,
linear warmup over the first 5% of the steps, cosine to 10% of the peak; seed 1234 for every run,
so all runs start from the same weights and see the same batches in the same order. Validation
every 100 steps and at the end on the same 21 micro-batches of 16 (336 of the 350 validation
windows, 86,016 tokens); no checkpoints.

Runs: ``fp8=none`` (bf16 autocast; fp32 on a CPU) and ``fp8=<recipe>`` for tensorwise, rowwise,
delayed, blockwise and mxfp8 (``mt_train/conf/fp8``). Reference runs of
``benchmarks/plain_llama.py``, a plain PyTorch loop with the same model shapes, budget, windows
and order: ``plain`` (bf16) and ``torchao-tensorwise`` / ``torchao-rowwise`` (torchao's float8
on it, blocks compiled); their ``+key=value`` overrides become ``--key value`` of that script
(``plain+sampler=random``). With ``--plain-init mt`` (the default) a plain run starts from
mt-train's initial weights of its seed, written once per seed to
``<out>/init_<model>_seed<seed>.safetensors``, so a same-seed pair shares weights, windows and
order and differs only in the training code. An mt run's ``+env.NAME=value`` sets an environment variable
(``none+env.MT_FP8_DISABLE_TRITON=1``: fused ops and AdamW in plain PyTorch). ``--seeds A,B,C``
runs every ``--recipes`` entry at each seed. A run ``<recipe>@<seed>`` in ``--recipes``
trains that recipe with another seed (other initial weights and batch order), in
``<out>/<recipe>_seed<seed>/``: ``none@5678`` measures how far bf16 moves from itself by seed
alone, the yardstick for the FP8 differences. A run may end in ``+key=value`` Hydra overrides of
its own (``tensorwise+fp8.output_head=true``; folder ``tensorwise__fp8.output_head-true``; a list
value keeps its commas: ``+fp8.output_head_gemms=[forward,dgrad]``). An FP8 run is compared
with the bf16 run of the same seed and the same non-``fp8.`` overrides when that run is there
(``delayed@5678`` with ``none@5678``, ``tensorwise+fp8.output_head=true+model.vocab_size=32768``
with ``none+model.vocab_size=32768``), else with ``none``. Such same-seed comparisons are
*pairs*: the ``paired`` table averages each FP8 configuration's pair differences over its seeds.

Verdicts: every FP8 recipe (without ``+`` overrides; those are variants, reported only) is
within 1% of bf16 when the mean of its pair differences is. With one seed that is the plain
comparison; with several, seed noise averages out: bf16 alone moved by 1.2% between seeds 1234,
5678 and 9999 at the default size (``docs/benchmarks-log.md``, 2026-12-04), as much as the band.
Parity (the ``parity`` table): each mt run against its plain counterpart of the same seed
(``none`` against ``plain``, ``tensorwise`` against ``torchao-tensorwise``, ``rowwise`` against
``torchao-rowwise``), and blockwise, delayed and mxfp8 against mt bf16; a target
(:data:`PARITY_TARGETS`, :data:`FP8_TARGETS`) is met when the mean over at least
:data:`MIN_SEEDS` seeds is within its bound. The final losses' spread over seeds is reported
per configuration.
Each run is ``python -m mt_train ...`` in its own
subprocess, exactly as a user runs ``mt-train`` with Hydra overrides, in ``<out>/<recipe>/``
(``metrics.jsonl``, Hydra's ``.hydra/``, and ``train.log`` with the run's stdout and stderr).
``--concurrent N`` runs N at once (default: all) on the one GPU: a small model's eager step
leaves the GPU idle while the host launches kernels, so one run's host time can overlap
another's GPU time. The corpus is prepared once (``--data-dir``, default a temporary folder) and
shared read-only.

Numbers (``<out>/fp8_quality.json``, rewritten after every finished run, and a Markdown table on
stdout): per recipe the validation curve ``[(step, val_loss)]``, the training-loss curve (one
step's loss every ``--log-interval`` steps), the final validation loss ``v``, ``ratio = v /
v_bf16`` and ``vs bf16 (%) = 100 · (ratio − 1)`` at the last step both runs evaluated (the final
step unless a run was stopped), "within 1%" meaning ``|ratio − 1| ≤ 0.01`` (for a pair; for
the mean of a configuration's pairs, ``|mean| ≤ 1%``), and the run's wall
seconds. A failed run is reported with the tail of its log; the others go on. ``--time-limit``
stops the runs still going at that many seconds (SIGTERM: the trainer finishes its step and
exits), so a run under a time budget still returns every curve so far; ``--collect`` rebuilds the
JSON and the table from an existing ``--out`` folder without training; ``--merge`` judges the
runs of several such JSON files together (runs of one training setup made at different
times; ``--recipes`` picks runs; a run in several files is taken from the last).

Run (repository root; GPU)::

    python3 benchmarks/fp8_quality.py --out results/fp8_quality --time-limit 330
    python3 benchmarks/plot_fp8_quality.py results/fp8_quality/fp8_quality.json

CPU smoke test (FP8 runs emulated; the block recipe refuses the debug model's 64-wide k/v
projections, which ``fp8.min_features=128`` keeps in high precision in every FP8 run)::

    python benchmarks/fp8_quality.py --model debug --steps 20 --out /tmp/q \
        --extra fp8.min_features=128
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted(str(p) for p in (REPO / "packages").glob("*/src"))
RECIPES = ("none", "tensorwise", "rowwise", "delayed", "blockwise", "mxfp8")
"""``fp8=`` config names; ``none`` is the bf16 reference."""
REFERENCE = "none"
PLAIN = "plain"
PLAIN_RUNS = {"plain": "none", "torchao-tensorwise": "tensorwise", "torchao-rowwise": "rowwise"}
"""Runs of ``benchmarks/plain_llama.py`` (plain PyTorch; torchao's float8 recipes on it) -> the
mt recipe each is the reference of."""
TOLERANCE = 0.01
PARITY_TARGETS = {"none": 0.3, "tensorwise": 0.3, "rowwise": 0.3}
"""mt recipe -> bound (%) on the seed-mean difference from its plain-PyTorch counterpart."""
FP8_TARGETS = {"blockwise": 0.5, "delayed": 0.5, "mxfp8": 0.5}
"""mt recipe without a plain counterpart -> bound (%) on its seed-mean difference from mt bf16."""
MIN_SEEDS = 3
RESULTS = "fp8_quality.json"
LOG = "train.log"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the runs and the JSON")
    p.add_argument("--model", default="llama_125m", help="model= config (debug for a smoke test)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps per run")
    p.add_argument(
        "--recipes",
        default=None,
        help="comma-separated fp8= configs (default: every recipe at --seed; with --merge: every "
        "run of the files) (commas inside [...] belong to a list override, as in tensorwise+fp8.output_head_gemms=[forward,dgrad]); 'none' (bf16) is the reference",
    )
    p.add_argument("--concurrent", type=int, default=0, help="runs at once (0: all of them)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--micro-batch", type=int, default=None, help="default: --batch")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of steps)")
    p.add_argument("--eval-interval", type=int, default=None, help="default: min(100, steps)")
    p.add_argument("--eval-batches", type=int, default=21, help="validation micro-batches")
    p.add_argument("--log-interval", type=int, default=None, help="default: min(10, steps)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--seeds",
        default=None,
        help="comma-separated seeds: every run of --recipes at each of them (recipe@seed)",
    )
    p.add_argument(
        "--extra",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="more Hydra overrides for every run (applied last)",
    )
    p.add_argument(
        "--time-limit",
        "--device-timeout",
        type=float,
        default=None,
        help="seconds from the first launch after which the runs still going are stopped "
        "(SIGTERM) and collected",
    )
    p.add_argument("--grace", type=float, default=20.0, help="seconds from SIGTERM to SIGKILL")
    p.add_argument("--data-dir", type=Path, default=None, help="prepared corpus (default: temp)")
    p.add_argument(
        "--plain-init",
        choices=("mt", "own"),
        default="mt",
        help="plain runs start from mt-train's initial weights of their seed (mt: a pair then "
        "differs only in the training code) or draw their own (own; also when a run sets +init=)",
    )
    p.add_argument("--python", default=sys.executable, help="interpreter for the runs")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument(
        "--collect",
        action="store_true",
        help="only rebuild the JSON from --out (pass the options of the run that wrote it)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON[:KEY]",
        default=None,
        help="judge together the runs of these fp8_quality.json files (KEY: a result nested "
        "under that key), e.g. from several machines or days; writes --out/fp8_quality.json",
    )
    args = p.parse_args(argv)
    args.recipes_given = args.recipes is not None
    args.recipes = [r for r in re.split(r",(?![^\[]*\])", args.recipes or ",".join(RECIPES)) if r]
    if args.seeds:
        args.recipes = [
            "+".join([f"{base.partition('@')[0]}@{seed}", *extra])
            for base, *extra in (spec.split("+") for spec in args.recipes)
            for seed in args.seeds.split(",")
        ]
    for spec in args.recipes:
        base, *extra = spec.split("+")
        recipe, _, seed = base.partition("@")
        if (
            recipe not in (*RECIPES, *PLAIN_RUNS)
            or (seed and not seed.isdigit())
            or not all("=" in e for e in extra)
        ):
            p.error(
                f"bad run {spec!r}: give a recipe ({', '.join([*RECIPES, *PLAIN_RUNS])}), optionally followed "
                "by @<seed> (a non-negative int) and +key=value overrides"
            )
    args.micro_batch = args.micro_batch or args.batch
    args.warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    args.eval_interval = args.eval_interval or min(100, args.steps)
    args.log_interval = args.log_interval or min(10, args.steps)
    args.concurrent = args.concurrent or len(args.recipes)
    return args


# ---------------------------------------------------------------- launching
def split_spec(spec: str, default_seed: int) -> tuple[str, int, list[str]]:
    """``"none@5678"`` -> ``("none", 5678, [])``; ``"tensorwise+fp8.output_head=true"`` ->
    ``("tensorwise", default_seed, ["fp8.output_head=true"])``."""
    base, *extra = spec.split("+")
    recipe, _, seed = base.partition("@")
    return recipe, int(seed) if seed else default_seed, extra


def run_folder(out: Path, spec: str) -> Path:
    base, *extra = spec.split("+")
    recipe, _, seed = base.partition("@")
    name = f"{recipe}_seed{seed}" if seed else recipe
    return out / "__".join([name, *(re.sub(r"[^A-Za-z0-9_.-]", "-", e) for e in extra)])


def reference_of(spec: str, specs: list[str]) -> str:
    """The bf16 run ``spec`` is compared with: for mt runs the ``none`` run at the same seed with
    the same non-FP8 overrides (``none@5678``, ``none+model.vocab_size=32768``) when it was run,
    for a bf16 run with overrides (an ablation) the bf16 run of its seed without them, else
    ``none`` (also for a bf16 run itself: ``none@5678`` against ``none`` is the seed-noise
    yardstick). Plain-PyTorch runs likewise against ``plain``."""
    recipe, _, extra = split_spec(spec, 0)
    ref = PLAIN if recipe in PLAIN_RUNS else REFERENCE
    seed = spec.split("+")[0].partition("@")[2]
    seeded = f"{ref}@{seed}" if seed else ref
    if recipe != ref:
        same = "+".join([seeded, *(e for e in extra if not e.startswith("fp8."))])
        if same in specs:
            return same
    elif extra and seeded in specs:
        return seeded
    return ref


def counterpart_of(spec: str, specs: list[str]) -> str | None:
    """The plain-PyTorch run an mt run is held to (``none@5678`` -> ``plain@5678``,
    ``tensorwise`` -> ``torchao-tensorwise``), overrides of the mt run notwithstanding; None
    when there is none or it was not run."""
    recipe, _, _ = split_spec(spec, 0)
    plain = {mt: name for name, mt in PLAIN_RUNS.items()}.get(recipe)
    if plain is None or recipe in PLAIN_RUNS:
        return None
    seed = spec.split("+")[0].partition("@")[2]
    name = f"{plain}@{seed}" if seed else plain
    return name if name in specs else None


def overrides(args: argparse.Namespace, spec: str, run_dir: Path, data_dir: Path) -> list[str]:
    """The Hydra overrides of one run (the same for every run but ``fp8=``, the seed and the
    run's own ``+key=value`` overrides, which come last)."""
    recipe, seed, extra = split_spec(spec, args.seed)
    return [
        f"model={args.model}",
        f"fp8={recipe}",
        "checkpoint=disabled",
        f"trainer.max_steps={args.steps}",
        f"trainer.seq_len={args.seq_len}",
        f"trainer.global_batch_size={args.batch}",
        f"trainer.micro_batch_size={args.micro_batch}",
        f"trainer.eval_interval={args.eval_interval}",
        f"trainer.eval_batches={args.eval_batches}",
        f"trainer.log_interval={args.log_interval}",
        f"trainer.seed={seed}",
        f"optimizer.lr={args.lr}",
        "scheduler=cosine",
        f"scheduler.warmup_steps={args.warmup}",
        "logging.progress_bar=false",
        f"data.path={_quoted(data_dir)}",
        f"trainer.output_dir={_quoted(run_dir)}",
        f"hydra.run.dir={_quoted(run_dir)}",  # Hydra's files go there too, not to ./outputs
        *args.extra,
        *extra,
    ]


def mt_command(args: argparse.Namespace, spec: str, run_dir: Path, data_dir: Path) -> Launch:
    """``python -m mt_train`` with :func:`overrides`; ``+env.NAME=value`` overrides of the run
    set environment variables instead (``+env.MT_FP8_DISABLE_TRITON=1``: the fused ops and
    AdamW in plain PyTorch)."""
    argv = overrides(args, spec, run_dir, data_dir)
    env = {e[4:].partition("=")[0]: e.partition("=")[2] for e in argv if e.startswith("env.")}
    argv = [e for e in argv if not e.startswith("env.")]
    return Launch([args.python, "-m", "mt_train", *argv], env)


def plain_command(args: argparse.Namespace, spec: str, run_dir: Path, data_dir: Path) -> Launch:
    """``benchmarks/plain_llama.py`` with the shapes of ``model=<args.model>`` (and any
    ``model.*`` of ``--extra``), the same budget and seed; the run's ``+key=value`` overrides
    become ``--key value`` (``plain+sampler=permutation``)."""
    sys.path[:0] = [s for s in SOURCES if s not in sys.path]
    from mt_train import compose_config, to_train_config

    model = to_train_config(
        compose_config([f"model={args.model}", *(e for e in args.extra if e.startswith("model."))])
    ).model
    vocab = model.vocab_size
    meta = data_dir / "meta.json"
    if vocab is None:  # mt-train's rule: the tokenizer's size rounded up to a multiple of 64
        tokens = json.loads(meta.read_text())["vocab_size"] if meta.is_file() else 257
        vocab = (tokens + 63) // 64 * 64
    name, seed, extra = split_spec(spec, args.seed)
    flags = {
        "data": data_dir, "out": run_dir, "steps": args.steps, "seq-len": args.seq_len,
        "batch": args.batch, "lr": args.lr, "warmup": args.warmup,
        "eval-interval": args.eval_interval, "eval-batches": args.eval_batches,
        "log-interval": args.log_interval, "seed": seed, "vocab-size": vocab, "dim": model.dim,
        "layers": model.n_layers, "heads": model.n_heads, "kv-heads": model.n_kv_heads,
        "ffn-dim": model.ffn_dim, "rope-theta": model.rope_theta,
        "rope-factor": model.rope_scaling.factor, "norm-eps": model.norm_eps,
        "float8": PLAIN_RUNS[name] if name != PLAIN else "none",
    }  # fmt: skip
    if args.micro_batch != args.batch:
        raise SystemExit("fp8_quality: plain runs take no --micro-batch (no accumulation)")
    for e in extra:
        key, _, value = e.partition("=")
        flags[key.replace("_", "-")] = value
    init = None
    if args.plain_init == "mt" and "init" not in flags:
        init = args.out / f"init_{args.model}_seed{seed}.safetensors"
        flags["init-from"] = init
    argv = [str(REPO / "benchmarks" / "plain_llama.py")]
    for key, value in flags.items():
        argv += [f"--{key}", str(value)]
    if name != PLAIN:  # torchao's float8 runs compiled (eager, its scaling is host-bound)
        argv.append("--compile")
    launch = Launch([args.python, *argv], {})
    if init is not None:
        launch.init = (init, dataclasses.replace(model, vocab_size=vocab), seed)
    return launch


def write_initial_weights(path: Path, model: Any, seed: int) -> None:
    """mt-train's initial weights of ``model`` at ``seed`` (its full tp=1 state dict), which
    the plain run of that seed loads (``--plain-init mt``)."""
    if path.is_file():
        return
    from safetensors.torch import save_file

    from mt_train.models.build import build_model

    state = build_model(model, "cpu", seed).state_dict()
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    tmp.replace(path)


def _quoted(path: Path) -> str:
    text = str(path.resolve())
    if "'" in text:
        raise SystemExit(f"fp8_quality: paths with a quote are not supported: {text}")
    return f"'{text}'"


def child_env(concurrent: int) -> dict[str, str]:
    env = dict(os.environ)
    # The checkout's sources first, so the runs train this tree's code with or without an install.
    env["PYTHONPATH"] = os.pathsep.join([*SOURCES, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    # NOTE: N processes that each start a thread per core would oversubscribe the host's
    # cores, which also have to launch every run's GPU kernels; share them out instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // concurrent)))
    return env


def prepare_data(folder: Path) -> None:
    sys.path[:0] = [s for s in SOURCES if s not in sys.path]
    from mt_train.data.prepare import prepare_bundled

    prepare_bundled(folder)


@dataclass
class Launch:
    """A run's command line, the environment variables it sets, and for a plain run that
    starts from mt's weights, (file, model config, seed) of those weights."""

    command: list[str]
    env: dict[str, str]
    init: tuple[Path, Any, int] | None = None


class Run:
    """One training subprocess (``python -m mt_train`` or the plain loop) and what became of it."""

    def __init__(self, recipe: str, folder: Path, launch: Launch, steps: int) -> None:
        self.recipe, self.folder = recipe, folder
        self.command, self.env, self.init = launch.command, launch.env, launch.init
        self.steps = steps  # the run's trainer.max_steps
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = self.ended = 0.0
        self.returncode: int | None = None
        self.terminated_at: float | None = None  # when --time-limit sent SIGTERM
        self.killed = False
        self.collected = False  # --collect: judged from its folder only

    def start(self, env: dict[str, str]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / LOG, "wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**env, **self.env},
                cwd=REPO,
            )
        self.started = time.perf_counter()

    def poll(self) -> bool:
        """True once the process has ended (and records how)."""
        if self.proc is None or self.returncode is not None:
            return self.returncode is not None
        rc = self.proc.poll()
        if rc is None:
            return False
        self.returncode, self.ended = rc, time.perf_counter()
        return True

    def stop(self, grace: float) -> None:
        """SIGTERM once (the trainer stops after its step); SIGKILL ``grace`` seconds later."""
        if self.proc is None or self.returncode is not None:
            return
        now = time.perf_counter()
        if self.terminated_at is None:
            # NOTE: once only: the trainer restores the default handler on the first SIGTERM,
            # so a second one would end it mid-step.
            self.proc.send_signal(signal.SIGTERM)
            self.terminated_at = now
        elif now - self.terminated_at > grace and not self.killed:
            self.proc.kill()
            self.killed = True

    @property
    def wall_s(self) -> float | None:
        if self.collected or self.returncode is None:
            return None
        return round(self.ended - self.started, 1)

    def status(self) -> str:
        if self.proc is None and not self.collected:
            return "not started (time limit)"
        if self.returncode is None and not self.collected:
            return "running"
        log = _read(self.folder / LOG)
        # A run stopped after writing its last evaluation (during shutdown) has its result.
        val, _, _ = read_metrics(self.folder)
        finished = ("\ndone: " in log and "stopped early by" not in log) or (
            bool(val) and val[-1][0] >= self.steps
        )
        if self.collected:
            return "ok" if finished else "incomplete"
        if self.terminated_at is not None:
            return "ok" if finished else f"stopped by --time-limit (exit {self.returncode})"
        return "ok" if self.returncode == 0 else f"failed (exit {self.returncode})"


def launch_all(args: argparse.Namespace, runs: list[Run]) -> None:
    env = child_env(args.concurrent)
    began = time.perf_counter()
    pending, running = list(runs), []
    last_report = began
    while pending or running:
        now = time.perf_counter()
        over = args.time_limit is not None and now - began > args.time_limit
        while pending and len(running) < args.concurrent and not over:
            run = pending.pop(0)
            run.start(env)
            running.append(run)
            print(f"[{now - began:6.0f} s] started {run.recipe}", flush=True)
        if over:
            pending.clear()
            for run in running:
                run.stop(args.grace)
        for run in [r for r in running if r.poll()]:
            running.remove(run)
            print(
                f"[{now - began:6.0f} s] {run.recipe}: {run.status()}, {run.wall_s} s", flush=True
            )
            if run.status() != "ok":
                print(tail(run.folder / LOG), flush=True)
            write_results(args, runs)
        if running and now - last_report > 30:
            last_report = now
            steps = ", ".join(f"{r.recipe} {last_step(r.folder)}" for r in running)
            print(f"[{now - began:6.0f} s] steps: {steps}", flush=True)
        time.sleep(0.5)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def tail(path: Path, lines: int = 25) -> str:
    text = _read(path).splitlines() or [f"(no output in {path})"]
    return "\n".join("    | " + line for line in text[-lines:])


# ---------------------------------------------------------------- collecting
def read_metrics(folder: Path) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """(val curve, train curve, tokens/s values) from a run's ``metrics.jsonl``."""
    val: list[list[float]] = []
    train: list[list[float]] = []
    tps: list[float] = []
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return val, train, tps
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a killed run
            continue
        if row.get("kind") == "eval" and "val_loss" in row:
            val.append([row["step"], row["val_loss"]])
        elif row.get("kind") == "train" and "loss" in row:
            train.append([row["step"], row["loss"]])
            if "tok/s" in row:
                tps.append(row["tok/s"])
    return val, train, tps


def last_step(folder: Path) -> int:
    _, train, _ = read_metrics(folder)
    return int(train[-1][0]) if train else 0


def log_lines(folder: Path) -> tuple[str | None, float | None]:
    """The trainer's ``mt-train: <model> Llama, ... on 1x <device> ...`` line and the training
    loop's seconds from its ``done: N steps in S s`` line (None where missing)."""
    described, train_s = None, None
    for line in _read(folder / LOG).splitlines():
        if (line.startswith("mt-train: ") and " Llama, " in line) or line.startswith(
            "plain_llama: "
        ):
            described = line
        elif line.startswith("done: ") and " steps in " in line:
            with contextlib.suppress(ValueError, IndexError):
                train_s = float(line.split(" steps in ")[1].split(" s")[0])
    return described, train_s


def summarize(args: argparse.Namespace, runs: list[Run]) -> dict[str, Any]:
    per: dict[str, dict[str, Any]] = {}
    for run in runs:
        val, train, tps = read_metrics(run.folder)
        described, train_s = log_lines(run.folder)
        entry: dict[str, Any] = {
            "fp8": run.recipe,
            "status": run.status(),
            "returncode": run.returncode,
            "wall_s": run.wall_s,
            "train_loop_s": train_s,
            "steps": int(train[-1][0]) if train else 0,
            "val_loss": val,
            "train_loss": train,
            "final_val_loss": val[-1][1] if val else None,
            "final_step": val[-1][0] if val else None,
            "median_tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,
            "trainer": described,
            "log": str(run.folder / LOG),
            "command": run.command,
        }
        is_fp8 = split_spec(run.recipe, args.seed)[0] not in (REFERENCE, *PLAIN_RUNS)
        if is_fp8 and described is not None and " linears)" not in described:
            entry["status"] += "; WARNING: the trainer reports no FP8 layers"
        per[run.recipe] = entry
    return judge(args, per)


def judge(args: argparse.Namespace, per: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Compare every run of ``per`` (spec -> entry with its ``val_loss`` curve) with its bf16
    reference, pair and average them, and judge the criterion (module docstring)."""
    for recipe, entry in per.items():
        counterpart = counterpart_of(recipe, list(per))
        entry["plain_reference"] = counterpart
        entry["vs_plain_pct"] = entry["vs_plain_step"] = None
        if counterpart is not None:
            pct = difference_pct(entry, per[counterpart])
            if pct is not None:
                entry["vs_plain_step"], entry["vs_plain_pct"] = pct
        reference = reference_of(recipe, list(per))
        ref = per.get(reference)
        ref_val = dict((int(s), v) for s, v in ref["val_loss"]) if ref else {}
        common = sorted(set(ref_val) & {int(s) for s, _ in entry["val_loss"]})
        entry["reference"] = reference
        entry["compare_step"] = common[-1] if common else None
        if not common or recipe == reference:
            entry.update(ratio_to_bf16=1.0 if common else None, vs_bf16_pct=None, within_1pct=None)
            continue
        v = dict((int(s), x) for s, x in entry["val_loss"])[common[-1]]
        ratio = v / ref_val[common[-1]]
        entry.update(
            ratio_to_bf16=ratio,
            vs_bf16_pct=100.0 * (ratio - 1.0),
            within_1pct=abs(ratio - 1.0) <= TOLERANCE,
        )
    pairs = paired(args, per)
    parity = plain_parity(args, per)
    # Judged: each FP8 recipe as configured (a "+override" run is a variant), by its difference
    # from bf16 averaged over the seeds that have their own bf16 run. bf16 alone moves by about
    # 1% between seeds at this size, as much as the band, so one seed's pair is mostly noise.
    verdicts = [p["within_1pct"] for name, p in pairs.items() if "+" not in name]
    return {
        "criterion": (
            "final validation loss of every FP8 recipe within 1% of bf16, averaged over the "
            "seeds run (each against the bf16 run of its seed)"
        ),
        "parity_criteria": (
            f"mt bf16, tensorwise and rowwise within {PARITY_TARGETS['none']}% of their plain "
            "PyTorch / torchao counterparts, blockwise, delayed and mxfp8 within "
            f"{FP8_TARGETS['blockwise']}% of mt bf16, each averaged over >= {MIN_SEEDS} seeds of "
            "same-seed pairs; mt bf16's seed spread no wider than the plain loop's"
        ),
        "parity": parity,
        "settings": {
            "model": args.model,
            "steps": args.steps,
            "seq_len": args.seq_len,
            "global_batch": args.batch,
            "micro_batch": args.micro_batch,
            "lr": args.lr,
            "warmup": args.warmup,
            "eval_interval": args.eval_interval,
            "eval_batches": args.eval_batches,
            "seed": args.seed,
            "concurrent": args.concurrent,
            "extra": args.extra,
        },
        "all_within_1pct": bool(verdicts) and all(v is True for v in verdicts),
        "paired": pairs,
        "runs": per,
    }


def difference_pct(entry: dict[str, Any], ref: dict[str, Any]) -> tuple[int, float] | None:
    """(step, 100·(v/v_ref − 1)) at the last step both runs evaluated, or None."""
    mine = {int(s): v for s, v in entry["val_loss"]}
    theirs = {int(s): v for s, v in ref["val_loss"]}
    common = sorted(set(mine) & set(theirs))
    if not common:
        return None
    return common[-1], 100.0 * (mine[common[-1]] / theirs[common[-1]] - 1.0)


def plain_parity(args: argparse.Namespace, per: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per mt configuration with plain-PyTorch counterparts: its same-seed differences from
    them and their mean; per configuration with a bf16 reference only (blockwise, delayed,
    mxfp8), the same against mt bf16; per configuration run at several seeds, the final losses
    and their spread ``100·(max − min)/mean``; and the targets judged (module docstring)."""
    diffs: dict[str, dict[int, float]] = {}
    finals: dict[str, dict[int, float]] = {}
    for spec, entry in per.items():
        recipe, seed, extra = split_spec(spec, args.seed)
        name = "+".join([recipe, *extra])
        if entry["final_val_loss"] is not None and entry["final_step"] == args.steps:
            finals.setdefault(name, {})[seed] = entry["final_val_loss"]
        if entry["vs_plain_pct"] is not None and entry["vs_plain_step"] == args.steps:
            diffs.setdefault(name, {})[seed] = entry["vs_plain_pct"]
        elif recipe in FP8_TARGETS and not extra and is_pair(spec, entry):
            diffs.setdefault(name, {})[seed] = entry["vs_bf16_pct"]
    configs = {}
    for name, by_seed in diffs.items():
        bound = PARITY_TARGETS.get(name, FP8_TARGETS.get(name))
        mean = sum(by_seed.values()) / len(by_seed)
        configs[name] = {
            "against": "mt bf16" if name in FP8_TARGETS else "plain PyTorch counterpart",
            "pct_by_seed": dict(sorted(by_seed.items())),
            "mean_pct": mean,
            "bound_pct": bound,
            "met": None if bound is None else len(by_seed) >= MIN_SEEDS and abs(mean) <= bound,
        }
    spreads = {
        name: {
            "final_by_seed": dict(sorted(by_seed.items())),
            "mean": sum(by_seed.values()) / len(by_seed),
            "spread_pct": 100.0
            * (max(by_seed.values()) - min(by_seed.values()))
            / (sum(by_seed.values()) / len(by_seed)),
        }
        for name, by_seed in finals.items()
        if len(by_seed) > 1
    }
    if "none" in spreads and PLAIN in spreads:
        spreads["none"]["no_wider_than_plain"] = (
            spreads["none"]["spread_pct"] <= spreads[PLAIN]["spread_pct"]
        )
    return {"configs": configs, "spreads": spreads}


def is_pair(spec: str, entry: dict[str, Any]) -> bool:
    """Whether FP8 run ``spec`` was compared with a bf16 run of its own seed and settings (not
    ``none`` across seeds or settings)."""
    recipe, _, extra = split_spec(spec, 0)
    if recipe in (REFERENCE, *PLAIN_RUNS) or entry["vs_bf16_pct"] is None:
        return False
    return entry["reference"] != REFERENCE or not (
        "@" in spec or any(not e.startswith("fp8.") for e in extra)
    )


def paired(args: argparse.Namespace, per: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per FP8 configuration (recipe and overrides), the difference from bf16 at each seed
    that has its own bf16 run, and their mean: seed noise moves both runs of a pair alike."""
    groups: dict[str, dict[int, float]] = {}
    for spec, entry in per.items():
        if not is_pair(spec, entry):
            continue
        recipe, seed, extra = split_spec(spec, args.seed)
        groups.setdefault("+".join([recipe, *extra]), {})[seed] = entry["vs_bf16_pct"]
    result = {}
    for name, by_seed in groups.items():
        mean = sum(by_seed.values()) / len(by_seed)
        result[name] = {
            "vs_bf16_pct_by_seed": dict(sorted(by_seed.items())),
            "mean_vs_bf16_pct": mean,
            "within_1pct": abs(mean) <= 100.0 * TOLERANCE,
        }
    return result


RUN_SETTINGS = ("concurrent",)
"""Settings that may differ between merged results: they do not change what a run computes."""


def merge_results(args: argparse.Namespace, sources: list[str]) -> dict[str, Any]:
    """The runs of several results, judged together: those of ``--recipes`` if given, else all.
    A run found in more than one source is taken from the last source that has it (list older
    or partial results first). Every source must share the training settings of the first,
    and ``args`` takes them, so that the seeds are read the same way."""
    per: dict[str, dict[str, Any]] = {}
    settings: dict[str, Any] | None = None
    for source in sources:
        path, _, key = source.partition(":")
        result = json.loads(Path(path).read_text())
        if key:
            result = result[key]
        these = {k: v for k, v in result["settings"].items() if k not in RUN_SETTINGS}
        if settings is None:
            settings = these
        elif these != settings:
            differ = sorted(
                k for k in set(these) | set(settings) if these.get(k) != settings.get(k)
            )
            raise SystemExit(f"--merge: {source} has other settings than {sources[0]}: {differ}")
        for spec, entry in result["runs"].items():
            if not args.recipes_given or spec in args.recipes:
                per[spec] = {**entry, "source": source}
    missing = [spec for spec in args.recipes if args.recipes_given and spec not in per]
    if missing:
        raise SystemExit(f"--merge: no run {missing} in {', '.join(sources)}")
    assert settings is not None  # argparse gives at least one source
    if args.recipes_given:
        per = {spec: per[spec] for spec in args.recipes}
    for name, value in settings.items():
        setattr(args, name.replace("global_batch", "batch"), value)
    args.recipes = list(per)
    return judge(args, per)


def write_results(args: argparse.Namespace, runs: list[Run]) -> dict[str, Any]:
    result = merge_results(args, args.merge) if args.merge else summarize(args, runs)
    path = args.out / RESULTS
    tmp = path.with_suffix(".json.tmp")
    # One line per curve point instead of json's three.
    text = re.sub(r"\[\s+(\S+),\s+(\S+)\s+\]", r"[\1, \2]", json.dumps(result, indent=1))
    tmp.write_text(text + "\n")
    tmp.replace(path)
    return result


def table(result: dict[str, Any]) -> str:
    rows = [
        "| run | final val loss | vs bf16 (%) | pair within 1% | vs plain (%) | wall s | status |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    steps = result["settings"]["steps"]
    for recipe, e in result["runs"].items():
        base, *extra = recipe.split("+")
        base, _, seed = base.partition("@")
        name = base
        if base == REFERENCE:  # fp8=none trains in the trainer's precision: fp32 on a CPU
            name = "fp32" if " fp32" in (e["trainer"] or "") else "bf16"
        name = "+".join([name, *extra])
        if seed or extra:
            name += f" (seed {seed or result['settings']['seed']})"
        loss = "—" if e["final_val_loss"] is None else f"{e['final_val_loss']:.4f}"
        if e["final_step"] not in (None, steps):
            loss += f" (step {e['final_step']})"
        pct = "—" if e["vs_bf16_pct"] is None else f"{e['vs_bf16_pct']:+.2f}"
        if e["compare_step"] not in (None, steps) and e["vs_bf16_pct"] is not None:
            pct += f" (at step {e['compare_step']})"
        plain = "—" if e.get("vs_plain_pct") is None else f"{e['vs_plain_pct']:+.2f}"
        if e.get("vs_plain_step") not in (None, steps):
            plain += f" (at step {e['vs_plain_step']})"
        within = {True: "yes", False: "no", None: "—"}[e["within_1pct"]]
        if not is_pair(recipe, e):
            within = "—"
        seconds = e["wall_s"] if e["wall_s"] is not None else e["train_loop_s"]  # --collect
        wall = "—" if seconds is None else f"{seconds:.0f}"
        rows.append(f"| {name} | {loss} | {pct} | {within} | {plain} | {wall} | {e['status']} |")
    if result.get("paired"):
        rows += [
            "",
            "| FP8 configuration | vs same-seed bf16 (%) by seed | mean (%) | mean within 1% |",
            "| --- | --- | --- | --- |",
        ]
        for name, p in result["paired"].items():
            seeds = ", ".join(f"{s}: {v:+.2f}" for s, v in p["vs_bf16_pct_by_seed"].items())
            within = "—" if "+" in name else {True: "yes", False: "**no**"}[p["within_1pct"]]
            rows.append(f"| {name} | {seeds} | {p['mean_vs_bf16_pct']:+.2f} | {within} |")
    parity = result.get("parity") or {}
    if parity.get("configs"):
        rows += [
            "",
            "| mt configuration | against | difference (%) by seed | mean (%) | target |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, p in parity["configs"].items():
            seeds = ", ".join(f"{s}: {v:+.2f}" for s, v in p["pct_by_seed"].items())
            met = {True: "met", False: "**missed**", None: "—"}[p["met"]]
            bound = "" if p["bound_pct"] is None else f"±{p['bound_pct']}% "
            rows.append(
                f"| {name} | {p['against']} | {seeds} | {p['mean_pct']:+.2f} | {bound}{met} |"
            )
    if parity.get("spreads"):
        rows += [
            "",
            "| configuration | final loss by seed | mean | spread (%) |",
            "| --- | --- | --- | --- |",
        ]
        for name, sp in parity["spreads"].items():
            seeds = ", ".join(f"{s}: {v:.4f}" for s, v in sp["final_by_seed"].items())
            rows.append(f"| {name} | {seeds} | {sp['mean']:.4f} | {sp['spread_pct']:.2f} |")
    return "\n".join(rows)


def report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    print("\n" + table(result))
    verdict = "yes" if result["all_within_1pct"] else "no"
    print(f"\nevery FP8 recipe within 1% of bf16: {verdict}  ({args.out / RESULTS})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        report(args, write_results(args, []))
        return 0
    tmp_data = None
    if args.data_dir is None and not args.collect:
        tmp_data = tempfile.TemporaryDirectory(prefix="fp8_quality_data_")
        args.data_dir = Path(tmp_data.name) / "kjv"
    data_dir = (args.data_dir or args.out / "data").resolve()
    if not args.collect:
        prepare_data(data_dir)  # first: plain runs read the vocabulary from it
    runs = []
    for recipe in args.recipes:
        folder = run_folder(args.out, recipe)
        build = plain_command if split_spec(recipe, 0)[0] in PLAIN_RUNS else mt_command
        runs.append(Run(recipe, folder, build(args, recipe, folder, data_dir), args.steps))
    if args.dry_run:
        for run in runs:
            print(" ".join(f"{k}={v}" for k, v in run.env.items()), " ".join(run.command))
        return 0
    if args.collect:
        for run in runs:
            run.collected = True
    else:
        print(
            f"fp8_quality: {len(runs)} runs of model={args.model}, {args.steps} steps of "
            f"{args.batch}x{args.seq_len} tokens, {args.concurrent} at once, into {args.out}",
            flush=True,
        )
        for run in runs:
            if run.init is not None:
                write_initial_weights(*run.init)
        try:
            launch_all(args, runs)
        finally:
            for run in runs:  # only after an error here (e.g. Ctrl-C): nothing left behind
                if run.proc is not None and run.returncode is None:
                    run.proc.kill()
            if tmp_data is not None:
                tmp_data.cleanup()
    report(args, write_results(args, runs))
    return 0 if all(run.status() == "ok" for run in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
