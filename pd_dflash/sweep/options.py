"""What a sweep run is asked (``RunOptions``), what it gives back (``Outcome``), and how a signal stops it."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from pd_dflash.sweep.connect import DEFAULT_CONNECT_TIMEOUT_S
from pd_dflash.sweep.resume import Mode


@dataclass
class RunOptions:
    out_dir: str
    mode: Mode = Mode.RESUME
    max_attempts: int = 3
    #: Per-cell watchdog; a cell running longer is killed and stored as TIMEOUT.
    cell_timeout_s: float = 3600.0
    #: A model load (runner start included) running longer is killed and counted as a load failure.
    load_timeout_s: float = 3600.0
    preflight_timeout_s: float = 180.0
    #: How long a cluster address (--address, $RAY_ADDRESS) may take to answer and let the driver join.
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    #: None: a bar on a terminal, log lines otherwise; False: log lines.
    progress: bool | None = None
    #: Calls kept on a runner: the running one plus one queued behind it (hides the dispatch round trip).
    queue_depth: int = 2
    breaker_threshold: int = 3
    poll_s: float = 0.5
    refresh_s: float = 2.0
    matrix_every_rows: int = 20
    matrix_every_s: float = 30.0
    #: Render the PNG plots with the final matrices (seconds of matplotlib; periodic rewrites never do).
    plots: bool = True
    #: Accept a cluster without token authentication (a warning instead of a refusal).
    insecure: bool = False

    def recorded(self) -> dict[str, Any]:
        """The options as sweep.json records them."""
        return {
            k: (str(v) if isinstance(v, Mode) else v) for k, v in self.__dict__.items() if k != "progress"
        }


class SweepInterrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived: raised by ``stops.StopRequest.check`` outside any Ray call."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


class ClusterLost(Exception):
    """The Ray cluster the sweep runs on died under it (the local raylet or GCS, or the connection to a cluster):
    the collector died with it, so the driver stops without the collector's help (``lost.py``)."""

    def __init__(self, cause: str, *, cells_run: int = 0, wall_s: float = 0.0) -> None:
        super().__init__(cause)
        self.cause = cause
        self.cells_run = cells_run
        self.wall_s = wall_s


@dataclass
class Outcome:
    exit_code: int
    out_dir: str
    counts: dict[str, int]
    #: Cells this run measured (rows stored, any status), and cells it could not run (no box left).
    cells_run: int
    unrun: int
    loads: int
    wall_s: float
    out_of_rotation: list[dict[str, Any]]
    #: finished, no_box_left, storage_failed, stopped (a signal) or cluster_lost (also in sweep.json).
    outcome: str = "finished"
    #: What stopped the sweep early: the signal's name, or the storage failure; None otherwise.
    stopped: str | None = None
    #: Orchestration figures (benchmarks/orchestrator.py): per-cell runner gaps, cell and load times.
    stats: dict[str, Any] = field(default_factory=dict)
