"""Where a sweep runs, and how it stops.

- **Cluster run**: join ``--address``, ``$RAY_ADDRESS`` or an already connected Ray. Preflight then refuses a
  cluster without token authentication unless ``--insecure`` (anyone who reaches its ports can run code).
- **Local mode**: a real single-node Ray cluster with fake GPUs (Ray's own ``local_mode`` no longer exists), bound
  to the loopback interface: Ray listens on every interface unless it believes it is not a cluster, which
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` tells it (GCS, raylet, workers and agents then bind to 127.0.0.1).
- **Stops**: SIGINT, SIGTERM and SIGHUP (an ssh session that drops) set a stop request (``stops.py``; the
  handler never raises, so no signal surfaces from inside a Ray call); the driver then stops the runners and
  writes what is stored (exit 130 / 143 / 129, outcome ``stopped``); a second signal while it does so is
  ignored. A driver started under ``nohup`` (SIGHUP ignored) keeps ignoring the hangup and finishes the sweep.
  A signal during ``ray.init`` (before the request is installed: Ray puts its own SIGTERM handler in place
  there) stops the run before anything is written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
from ray._private import ray_constants

from pd_dflash.errors import InputError
from pd_dflash.spec import SweepSpec
from pd_dflash.spec_inputs import check_local_start
from pd_dflash.sweep import preflight
from pd_dflash.sweep.connect import Address, bounded, parse_address, reach
from pd_dflash.sweep.driver import SweepDriver
from pd_dflash.sweep.lost import LocalWatch, lost_outcome
from pd_dflash.sweep.options import ClusterLost, Outcome, RunOptions, SweepInterrupted
from pd_dflash.sweep.out_names import check_out_names
from pd_dflash.sweep.resume import check_resumable, probe_writable
from pd_dflash.sweep.sink import NAMESPACE
from pd_dflash.sweep.stops import stop_on_signals

#: Ray's switch for "this is a multi-machine cluster"; off, every Ray process binds to the loopback interface.
CLUSTER_SWITCH_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def local_cluster_args(spec: SweepSpec) -> dict[str, Any]:
    """``ray.init`` arguments of local mode: a single-node cluster with fake GPUs and the spec's resources."""
    hw = spec.hardware
    gpus = spec.local.fake_gpus
    resources: dict[str, float] = {}
    if hw.accelerator_type:
        resources[f"{preflight.ACCELERATOR_PREFIX}{hw.accelerator_type}"] = 1
    if hw.custom_resource:
        resources[hw.custom_resource] = gpus
    runners = gpus // hw.gpus_per_cell
    cpus = spec.local.num_cpus or max(1, int(-(-runners * hw.cpus_per_runner // 1)))
    return {
        "num_cpus": cpus,
        "num_gpus": gpus,
        "resources": resources,
        "include_dashboard": False,
        "object_store_memory": spec.local.object_store_mb * 2**20,
        "namespace": NAMESPACE,
        "log_to_driver": False,
    }


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """While inside, a Ray started by this process (and the processes it starts) binds to 127.0.0.1 only."""
    saved_env, saved_switch = os.environ.get(CLUSTER_SWITCH_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[CLUSTER_SWITCH_ENV] = "0"  # for the processes Ray starts
    ray_constants.ENABLE_RAY_CLUSTER = False  # for this one, which imported Ray already
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_switch
        if saved_env is None:
            os.environ.pop(CLUSTER_SWITCH_ENV, None)
        else:
            os.environ[CLUSTER_SWITCH_ENV] = saved_env


def run_sweep(spec: SweepSpec, options: RunOptions, *, address: str | None = None) -> Outcome:
    """Run a sweep: join ``address`` (or $RAY_ADDRESS, or an already connected Ray), else start local mode."""
    options.out_dir = os.path.abspath(options.out_dir)
    _check_encodable(options.out_dir)
    target = None if ray.is_initialized() else cluster_address(address)
    local = not ray.is_initialized() and target is None
    owns_ray = not ray.is_initialized()
    started = time.monotonic()
    with loopback_only() if local else contextlib.nullcontext():
        try:
            try:
                _join_or_start(spec, options, target, local)
            except (KeyboardInterrupt, SystemExit) as exc:  # a signal before the stop request is installed
                signum = _signal_of(exc)
                return _stopped_early(options, SweepInterrupted(signum), time.monotonic() - started)
            watch = LocalWatch(ray._private.worker._global_node) if local else None
            with stop_on_signals() as stop:  # after ray.init, which installs a SIGTERM handler of its own
                try:
                    driver = SweepDriver(spec, options, local=local, stop=stop)
                    if watch is not None:
                        driver.cluster_lost = watch.lost
                    return driver.run()
                except SweepInterrupted as early:  # before OUT was opened: nothing to write
                    return _stopped_early(options, early, time.monotonic() - started)
                except ClusterLost as lost:
                    if watch is not None:
                        watch.stop()  # what is left of it, so the dead collector's lock on OUT is released
                    return lost_outcome(spec, options, lost, local=local)
        finally:
            if owns_ray:
                ray.shutdown()


def _join_or_start(spec: SweepSpec, options: RunOptions, target: Address | None, local: bool) -> None:
    """Join the cluster at ``target`` (bounded by --connect-timeout), or check OUT and start local mode."""
    if target is not None:
        reach(target, options.connect_timeout_s)
        with bounded(target, options.connect_timeout_s):
            ray.init(address=target.text.strip(), namespace=NAMESPACE, log_to_driver=False)
    elif local:
        # Local mode: this process is the head box, so OUT can be checked before a cluster is started.
        probe_writable(Path(options.out_dir))
        check_out_names(Path(options.out_dir))  # before anything in OUT is read (store.open again)
        check_resumable(Path(options.out_dir), spec, options.mode)
        check_local_start(spec)  # a named error, not Ray's ValueError about its memory
        # address="local": always start our own cluster, never join one another process left running.
        ray.init(address="local", **local_cluster_args(spec))


def _signal_of(exc: BaseException) -> int:
    """The signal behind an exit while Ray starts: SIGINT's KeyboardInterrupt, or the ``sys.exit(SIGTERM)``
    of the handler ``ray.init`` installs; anything else is raised again."""
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(exc, SystemExit) and exc.code == signal.SIGTERM:
        return signal.SIGTERM
    raise exc


def _check_encodable(out_dir: str) -> None:
    """OUT as an absolute path must be text Ray can carry: a working directory or --out this locale cannot
    decode (non-ASCII under LC_ALL=C, PYTHONUTF8=0) is refused naming the encoding, before Ray starts."""
    try:
        out_dir.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(
            f"{os.fsencode(out_dir)!r} is not valid in this locale's filesystem encoding "
            f"({sys.getfilesystemencoding()}); run under a UTF-8 locale (LC_ALL=C.UTF-8 or PYTHONUTF8=1) or "
            "choose an ASCII path",
            where="--out",
        ) from None


def cluster_address(address: str | None) -> Address | None:
    """The cluster to join: ``--address``, else ``$RAY_ADDRESS`` (set by ``ray job submit``), parsed; None for
    local mode (neither given, or ``local``)."""
    source, text = ("--address", address) if address else ("RAY_ADDRESS", os.environ.get("RAY_ADDRESS"))
    if text is None or (source == "RAY_ADDRESS" and not text.strip()) or text.strip() == "local":
        return None
    return parse_address(text, source)


def _stopped_early(options: RunOptions, stop: SweepInterrupted, wall_s: float) -> Outcome:
    return Outcome(
        exit_code=128 + stop.signum,
        out_dir=options.out_dir,
        counts={},
        cells_run=0,
        unrun=0,
        loads=0,
        wall_s=wall_s,
        out_of_rotation=[],
        outcome="stopped",
        stopped=stop.name,
    )
