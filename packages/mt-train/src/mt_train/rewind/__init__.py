"""Rewind: detect anomalies, agree on them over all ranks, go back to a stable checkpoint, skip
the data that led there, cool the LR, bound the retries, log every event; plus preemption
(SIGTERM/SIGINT) and fault injection. The math and invariants are in each module's docstring:

* :mod:`~mt_train.rewind.detectors` — signals, the median/MAD baseline, the detectors;
* :mod:`~mt_train.rewind.consensus` — one verdict for all ranks;
* :mod:`~mt_train.rewind.snapshot` — in-memory snapshots and the stable rule;
* :mod:`~mt_train.rewind.manager` — skip policies, LR cool-down, the bound;
* :mod:`~mt_train.rewind.events` — the events log;
* :mod:`~mt_train.rewind.faults` — fault injection;
* :mod:`~mt_train.rewind.preemption` — stop at a step boundary on a signal;
* :mod:`~mt_train.rewind.recovery` — verified resume, rejected checkpoints, decisions file.
"""

from mt_train.rewind.consensus import Verdict, agree
from mt_train.rewind.detectors import PRIORITY, DetectorSuite, RobustBaseline, StepSignals
from mt_train.rewind.events import EVENTS_FILE, EventLog, console_line, read_events
from mt_train.rewind.faults import FaultInjector, corrupt_latest
from mt_train.rewind.manager import RewindLimitError, RewindManager
from mt_train.rewind.preemption import StopRequest
from mt_train.rewind.recovery import Recovery
from mt_train.rewind.snapshot import Target, Targets, capture, live_state, restore

__all__ = [
    "EVENTS_FILE",
    "PRIORITY",
    "DetectorSuite",
    "EventLog",
    "FaultInjector",
    "Recovery",
    "RewindLimitError",
    "RewindManager",
    "RobustBaseline",
    "StepSignals",
    "StopRequest",
    "Target",
    "Targets",
    "Verdict",
    "agree",
    "capture",
    "console_line",
    "corrupt_latest",
    "live_state",
    "read_events",
    "restore",
]
