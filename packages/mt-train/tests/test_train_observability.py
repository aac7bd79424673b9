"""Observability: profiler windows, memory snapshots, the step-time breakdown, hang diagnostics.

The profiler and breakdown tests train the tiny job in-process; the watchdog and the collective
timeout need processes that die, so they run ``mt-train`` in processes of their own (one rank,
and two gloo ranks given torchrun's variables) with a ``fault.hang_at_step`` drill, forked with
torch and mt_train already imported (``cli_checks.Forked``).
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
from pathlib import Path

import pytest
import torch
from cli_checks import Forked, mt_train_main, run_forked, torchrun_env
from torch.distributed.flight_recorder.components.loader import read_dump
from train_checks import fit, tiny_overrides

from mt_comm.testing import free_port
from mt_train import compose_config, to_train_config
from mt_train.cli import validate_overrides
from mt_train.config.observability import ProfilingConfig
from mt_train.profiling import Profiler
from mt_train.step_timer import PHASES
from mt_train.watchdog import EXIT_COLLECTIVE_TIMEOUT, EXIT_HANG, flight_recorder_env

PROCESS_TIMEOUT_S = 240
"""Per process; a tiny run's process takes seconds on two loaded CPU cores."""


def _records(run: Path, kind: str = "train") -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_profiled_window_writes_a_trace_naming_our_phases(kjv_data: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(kjv_data, **{"profiling": "trace", "profiling.steps": "[3,4]"})
    _, summary = fit(overrides, tmp_path)
    trace = tmp_path / "profile" / "rank0_step3-4.pt.trace.json"
    assert summary.traces == [str(trace)]
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    for phase in ("data", "forward_backward", "grad_sync", "optimizer"):
        assert f"mt.{phase}" in names, sorted(n for n in names if n and n.startswith("mt."))
    assert "aten::mm" in names  # the model's GEMMs, by the op's name
    # Two recorded steps (3 and 4), nothing of the warm-up step 2 or of steps 5-8.
    assert len({n for n in names if n and n.startswith("ProfilerStep#")}) == 2


def test_profiler_schedule_follows_absolute_steps(tmp_path: Path) -> None:
    cfg = ProfilingConfig(enabled=True, steps=[4, 5], warmup=2, every=10)
    profiler = Profiler(cfg, tmp_path, 0, "cpu", announce=print)
    actions = {step: profiler.action(step).name for step in range(1, 17)}
    assert [s for s, a in actions.items() if a == "WARMUP"] == [2, 3, 12, 13]
    assert [s for s, a in actions.items() if a == "RECORD"] == [4, 14]
    assert [s for s, a in actions.items() if a == "RECORD_AND_SAVE"] == [5, 15]


def test_memory_snapshot_is_refused_without_cuda(kjv_data: Path) -> None:
    error = validate_overrides(
        [*tiny_overrides(kjv_data), "profiling=memory", "trainer.device=cpu"]
    )
    assert error is not None and "\n" not in error
    assert "profiling.memory_snapshot=true" in error and "'cpu'" in error


@pytest.mark.gpu
def test_memory_snapshot_of_one_step(kjv_data: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(kjv_data, **{"profiling": "memory", "profiling.steps": "[2,2]"})
    _, summary = fit(overrides, tmp_path)
    path = tmp_path / "profile" / "rank0_memory_step2-2.pickle"
    assert summary.traces == [str(path)]
    with open(path, "rb") as f:
        snapshot = pickle.load(f)  # torch's own snapshot format (memory_viz reads it)
    events = [e for trace in snapshot["device_traces"] for e in trace]
    assert any(e["action"] == "alloc" for e in events)


def test_step_breakdown_sums_to_the_step_time(kjv_data: Path, tmp_path: Path) -> None:
    _, summary = fit(tiny_overrides(kjv_data), tmp_path)
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [4, 8]
    tokens_per_step = 8 * 64
    for record in records:
        parts = sum(record[f"time/{phase}"] for phase in PHASES)
        # The phases partition the interval: their sum is the step time up to float rounding.
        assert parts == pytest.approx(record["time/step"], rel=1e-9)
        # Against an independent clock (tokens/s from Throughput, read a few microseconds
        # apart from the timer's boundaries at each end of a 4-step interval of >= 10 ms):
        assert record["time/step"] == pytest.approx(tokens_per_step / record["tok/s"], rel=0.05)
        assert record["time/forward_backward"] > 0 and record["time/optimizer"] > 0
        assert record["time/step_max"] == record["time/step"]  # one rank
    # The step-4 checkpoint is saved after step 4's record: its stall is in step 8's.
    assert records[0]["time/checkpoint"] == 0 and records[1]["time/checkpoint"] > 0
    assert summary.checkpoints_written == 2 and summary.tokens == 8 * tokens_per_step


def test_step_breakdown_can_be_switched_off(kjv_data: Path, tmp_path: Path) -> None:
    fit(tiny_overrides(kjv_data, **{"logging.step_breakdown": "false"}), tmp_path)
    assert not any(key.startswith("time/") for r in _records(tmp_path) for key in r)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("profiling.steps=[3]", "profiling.steps must be [first, last]"),
        ("profiling.steps=[4,3]", "profiling.steps[1] must be an integer >= 4"),
        ("profiling.steps=[0,3]", "profiling.steps[0] must be an integer >= 1"),
        ("profiling.warmup=3", "profiling.warmup=3"),
        ("profiling.every=2", "profiling.every=2"),
        ("profiling.folder=/tmp/x", "profiling.folder='/tmp/x'"),
        ("profiling.memory_snapshot_entries=0", "profiling.memory_snapshot_entries"),
        ("profiling.memory_snapshot_stacks=cpp", "profiling.memory_snapshot_stacks='cpp'"),
        ("comm.timeout_s=0", "comm.timeout_s must be > 0"),
        ("comm.trace_buffer_size=-1", "comm.trace_buffer_size must be an integer >= 0"),
        ("trainer.step_timeout_s=-1", "trainer.step_timeout_s must be > 0"),
        ("logging.wandb_mode=cloud", "logging.wandb_mode='cloud' is unknown"),
        ("logging.loggers=[x,x]", "names a logger twice"),
        ("fault.hang_s=0", "fault.hang_s must be > 0"),
    ],
)
def test_new_fields_reject_bad_values_in_one_line(
    kjv_data: Path, override: str, named: str
) -> None:
    error = validate_overrides([*tiny_overrides(kjv_data), override])
    assert error is not None and "\n" not in error
    assert named in error


def test_flight_recorder_env_respects_what_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from mt_train.config.observability import CommConfig

    for name in (
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    flight_recorder_env(CommConfig(trace_buffer_size=0))
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ
    flight_recorder_env(CommConfig(trace_buffer_size=2000))
    assert (
        os.environ["TORCH_FR_BUFFER_SIZE"] == os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    )
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"  # the user's choice stands


def test_watchdog_dumps_stacks_of_a_hung_step(kjv_data: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(
        kjv_data,
        # Steps 1 and 2 of the tiny model take milliseconds: 3 s is a wide margin under load.
        **{"fault.hang_at_step": 3, "trainer.step_timeout_s": 3, "trainer.output_dir": tmp_path},
    )
    done = run_forked([*overrides, f"hydra.run.dir={tmp_path}"], PROCESS_TIMEOUT_S, cwd=tmp_path)
    assert done.returncode == EXIT_HANG, done.stderr[-2000:]
    dump = (tmp_path / "hang" / "rank0.txt").read_text()
    assert "step 3 ran longer than trainer.step_timeout_s=3 s" in dump
    assert 'File "' in dump and "faults.py" in dump and "begin_step" in dump  # where it hangs
    assert f"every thread's Python stack is in {tmp_path / 'hang' / 'rank0.txt'}" in done.stderr


def test_collective_timeout_names_the_rank_and_the_collective(
    kjv_data: Path, tmp_path: Path
) -> None:
    """Rank 1 hangs before step 3; rank 0's next collective times out after comm.timeout_s,
    and rank 1's watchdog leaves its stacks. Both leave their flight recorder's buffer (gloo's
    recorder in torch 2.13), and rank 0's line names the newest collective in it. Step 2's
    record, logged before, holds the slowest rank's step time (one all-reduce MAX)."""
    overrides = tiny_overrides(
        kjv_data,
        **{
            "fault.hang_at_step": 3,
            "fault.rank": 1,
            "fault.hang_s": 60,
            "trainer.log_interval": 2,
            # Margins for two loaded cores: the ranks start together (forked with their imports
            # done), so the skew between them stays well below the collective timeout, which
            # stays below the watchdog's.
            "comm.timeout_s": 4,
            "comm.trace_buffer_size": 100,
            "trainer.step_timeout_s": 7,
            "trainer.output_dir": tmp_path,
        },
    )
    args, port = [*overrides, f"hydra.run.dir={tmp_path}"], free_port()
    ranks = [
        Forked(mt_train_main, args, cwd=tmp_path, env=torchrun_env(rank, 2, port))
        for rank in (0, 1)
    ]
    done = [rank.wait(PROCESS_TIMEOUT_S) for rank in ranks]
    out = "".join(d.stdout + d.stderr for d in done)
    assert [d.returncode for d in done] == [EXIT_COLLECTIVE_TIMEOUT, EXIT_HANG], out[-3000:]
    lines = [line for line in out.splitlines() if "timed out after comm.timeout_s=4 s" in line]
    assert lines, out[-3000:]
    assert "mt-train: rank 0: collective gloo:all_reduce #" in lines[0], lines[0]
    assert "called from" in lines[0] and "flight_recorder/rank_0" in lines[0], lines[0]
    for rank in (0, 1):
        dump = read_dump("rank_", str(tmp_path / "flight_recorder" / f"rank_{rank}"))
        assert dump["rank"] == rank and dump["entries"][-1]["profiling_name"].startswith("gloo:")
    assert "begin_step" in (tmp_path / "hang" / "rank1.txt").read_text()
    (record,) = _records(tmp_path)
    assert record["step"] == 2 and record["time/step_max"] >= record["time/step"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_profiler_refuses_memory_snapshot_on_cpu(tmp_path: Path) -> None:
    cfg = ProfilingConfig(memory_snapshot=True)
    with pytest.raises(ValueError, match="records the CUDA allocator's history"):
        Profiler(cfg, tmp_path, 0, "cpu", announce=print)


class FakeEvent:
    """A device event on a fake clock: complete once the fake device has reached its time."""

    def __init__(self, device: FakeStreamDevice) -> None:
        self.device, self.t = device, 0.0

    def record(self) -> None:
        self.t = self.device.clock

    def query(self) -> bool:
        return self.t <= self.device.reached

    def synchronize(self) -> None:
        self.device.reached = max(self.device.reached, self.t)

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t - self.t) * 1e3  # milliseconds, as torch.cuda.Event reports


class FakeStreamDevice:
    type, has_streams = "cpu", True

    def __init__(self) -> None:
        self.clock, self.reached = 0.0, -1.0

    def event(self, enable_timing: bool = False) -> FakeEvent:
        return FakeEvent(self)

    def memory_stats(self) -> dict[str, int]:
        return {"reserved": 3 * 2**30}


def test_step_timer_events_fold_as_they_complete() -> None:
    from mt_train.step_timer import StepTimer

    device = FakeStreamDevice()
    timer = StepTimer(device)
    for t, phase in [(0, "data"), (1, "forward_backward"), (3, "grad_sync"), (3.5, "optimizer")]:
        device.clock = t
        timer.start(phase)
    assert len(timer._pending) == 4  # the device has reached none of them: all in flight
    device.reached, device.clock = 3.5, 4.0
    timer.start("data")
    assert len(timer._pending) == 2  # folded up to the last completed boundary
    device.clock = 5.0
    out = timer.summary(steps=1)
    assert out["time/data"] == 2.0 and out["time/forward_backward"] == 2.0
    assert out["time/grad_sync"] == out["time/optimizer"] == 0.5
    assert out["time/step"] == out["time/step_max"] == 5.0 and out["mem_reserved_gib"] == 3.0
    device.clock = 6.0
    timer.start("data")
    assert timer.summary(steps=1)["time/logging"] == 1.0  # the next interval starts at the log


def test_out_of_memory_is_one_line_and_exit_1(
    kjv_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from mt_train import cli
    from mt_train.trainer import Trainer

    def out_of_memory(self: Trainer) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setattr(Trainer, "fit", out_of_memory)
    status = cli.main([*tiny_overrides(kjv_data), f"hydra.run.dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == cli.EXIT_OUT_OF_MEMORY == 1
    assert err[-1] == (
        "mt-train: rank 0: out of memory at step 1; profiling.memory_snapshot=true "
        "profiling.steps=[1,1] records a snapshot of it"
    )


def test_end_of_run_summary(kjv_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from mt_train.cli import print_summary

    overrides = tiny_overrides(kjv_data, **{"profiling": "trace", "profiling.steps": "[3,4]"})
    _, summary = fit(overrides, tmp_path)
    capsys.readouterr()
    print_summary(summary)
    text = capsys.readouterr().out
    assert "done: 8 steps, 4,096 tokens in " in text
    assert f"(best interval {summary.best_tokens_per_s:,.0f})" in text
    assert summary.best_tokens_per_s >= summary.tokens_per_s > 0
    assert "peak memory " in text and "checkpoints written: 2; rewinds: 0" in text
    assert f"profiles: {tmp_path / 'profile' / 'rank0_step3-4.pt.trace.json'}" in text


@pytest.mark.gpu
def test_out_of_memory_writes_a_snapshot(
    kjv_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from mt_train import cli
    from mt_train.trainer import Trainer

    train_step = Trainer.train_step

    def step_then_overflow(self: Trainer) -> dict:
        if self.step == 2:
            free, _ = torch.cuda.mem_get_info()
            torch.empty(2 * free, dtype=torch.uint8, device=self.device)  # a real allocator OOM
        return train_step(self)

    monkeypatch.setattr(Trainer, "train_step", step_then_overflow)
    overrides = [*tiny_overrides(kjv_data), "profiling=memory", "profiling.steps=[1,1]"]
    status = cli.main([*overrides, f"hydra.run.dir={tmp_path}"])
    snapshot = tmp_path / "profile" / "rank0_oom.pickle"
    assert status == 1 and snapshot.is_file()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("mt-train: rank 0: out of memory at step 3; memory snapshot in ")
    assert str(snapshot) in line and "memory_viz" in line


def _readme_profiling_commands() -> list[list[str]]:
    readme = Path(__file__).parents[1] / "README.md"
    text = readme.read_text().split("## Profiling and debugging", 1)[1].split("\n## ", 1)[0]
    text = text.replace("\\\n", " ")  # continuation lines
    commands = []
    for line in text.splitlines():
        if not line.startswith(("mt-train ", "torchrun ")):
            continue
        words = shlex.split(line, comments=True)
        if words[:1] == ["mt-train"]:
            commands.append(words[1:])
        elif words[:1] == ["torchrun"] and "mt_train" in words:
            commands.append(words[words.index("mt_train") + 1 :])
    return commands


@pytest.mark.parametrize("args", _readme_profiling_commands(), ids=lambda a: " ".join(a)[-60:])
def test_readme_profiling_commands_compose(args: list[str]) -> None:
    # Every command of the README's "Profiling and debugging" section passes validation as
    # written (running them is what the tests above do on the tiny model).
    to_train_config(compose_config(args))


@pytest.mark.gpu
def test_cuda_window_names_kernels_and_the_breakdown_uses_events(
    kjv_data: Path, tmp_path: Path
) -> None:
    overrides = tiny_overrides(
        kjv_data, **{"profiling": "trace", "profiling.steps": "[3,4]", "trainer.device": "cuda"}
    )
    _, summary = fit(overrides, tmp_path)
    events = json.loads(Path(summary.traces[0]).read_text())["traceEvents"]
    kernels = {e["name"] for e in events if e.get("cat") == "kernel"}
    gemm_names = ("gemm", "nvjet", "cutlass", "matmul")  # cuBLAS(Lt) and CUTLASS kernel names
    assert any(g in k.lower() for k in kernels for g in gemm_names), sorted(kernels)[:40]
    assert "mt.forward_backward" in {e.get("name") for e in events}
    tokens_per_step = 8 * 64
    for record in _records(tmp_path):
        parts = sum(record[f"time/{phase}"] for phase in PHASES)
        assert parts == pytest.approx(record["time/step"], rel=1e-9)
        # Device-event time between log points against the host clock of Throughput; both
        # intervals end at a synchronisation, so they differ by launch latencies only.
        assert record["time/step"] == pytest.approx(tokens_per_step / record["tok/s"], rel=0.05)
        assert record["mem_reserved_gib"] >= record["mem_gib"] > 0


def test_watchdog_backstop_is_armed_per_step_and_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import faulthandler

    from mt_train import watchdog

    armed: list[tuple] = []
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda t, **k: armed.append((t, k)))
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: armed.append(()))
    dog = watchdog.StepWatchdog(7.0, tmp_path, rank=0)
    dog.beat(1)
    dog.beat(2)
    dog.pause()
    dog.close()
    backstop = (7.0 + watchdog.BACKSTOP_GRACE_S, {"exit": True})
    assert armed == [backstop, backstop, (), ()]
    assert not (tmp_path / "hang").exists()  # nothing fired
