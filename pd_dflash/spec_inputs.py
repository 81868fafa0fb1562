"""Spec values that their types accept but a runner would choke on, refused where the spec is read (exit 2).

Two kinds of check:

- **what the spec says** (``spec.parse_spec`` and the field types, every command): no string anywhere holds a NUL
  (a path, an environment variable or a process argument cannot carry one), an ``env`` name is one the OS
  accepts (non-empty, no ``=``), a ``workload.chat_date`` is a real ``YYYY-MM-DD`` date;
- **what this process can encode** (:func:`check_locale`, every command that loads a spec file, before any
  file is touched): every string of the spec in the filesystem encoding (a non-ASCII path under ``LC_ALL=C``);
- **what this machine can say** (:func:`check_here`, ``plan`` and ``run`` only: ``report --spec`` may run
  elsewhere): a prompt file the spec names exists and is readable here, and local mode's object store fits
  this machine's memory. What only the boxes can check is theirs (a named REFUSED cell, never Ray's text).
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from pd_dflash.errors import InputError, excerpt

#: The date chat templates render (gpt-oss's harmony template inserts ``strftime_now(...)``) when
#: ``workload.chat_date`` is not set: fixed, so prompt tokens are the same on every day and every box.
DEFAULT_CHAT_DATE = "2025-08-05"
#: Ray refuses a node whose task memory (available − object store) is below this (its ``ValueError``).
RAY_MIN_TASK_MEMORY = 100 * 10**6


def _env_name(name: str) -> str:
    if not name or "=" in name:
        raise ValueError(
            f"environment variable name {excerpt(name)} is not one the OS accepts (it must be non-empty and "
            "hold no '=')"
        )
    return name


def _iso_date(value: str) -> str:
    try:
        parsed = datetime.date.fromisoformat(value)
    except ValueError:
        raise ValueError(f"must be a date as YYYY-MM-DD, got {excerpt(value)}") from None
    if parsed.isoformat() != value:
        raise ValueError(f"must be a date as YYYY-MM-DD, got {excerpt(value)}")
    return value


#: Ray's resource granularity (``MIN_RESOURCE_GRANULARITY``): a smaller fraction is its ValueError.
RAY_GRANULARITY = 0.0001
#: Resource names Ray keeps for itself (its own keywords, or prefixes it adds to every node).
RAY_RESERVED = ("CPU", "GPU", "memory", "object_store_memory")
RAY_RESERVED_PREFIXES = ("node:", "accelerator_type:")


def _ray_quantity(value: float) -> float:
    if 0 < value < RAY_GRANULARITY:
        raise ValueError(f"Ray cannot request less than {RAY_GRANULARITY} of a resource (use 0 or more)")
    return value


def _ray_resource(name: str) -> str:
    if name in RAY_RESERVED or name.startswith(RAY_RESERVED_PREFIXES):
        raise ValueError(
            f"{excerpt(name)} is a name Ray keeps for itself ({', '.join(RAY_RESERVED)}, "
            f"{', '.join(p + '*' for p in RAY_RESERVED_PREFIXES)}): name the resource you gave `ray start`"
        )
    return name


EnvName = Annotated[str, AfterValidator(_env_name)]
ChatDate = Annotated[str, AfterValidator(_iso_date)]
#: A resource quantity Ray accepts (0, or at least its granularity; at most 65,536 per runner).
RayQuantity = Annotated[float, Field(ge=0.0, le=65536.0, allow_inf_nan=False), AfterValidator(_ray_quantity)]
RayResource = Annotated[str, Field(min_length=1), AfterValidator(_ray_resource)]


def check_no_nul(data: Any, source: str, path: tuple[str, ...] = ()) -> None:
    """Refuse a NUL character in any string of the raw spec (keys too), naming the field."""
    if isinstance(data, str):
        if "\x00" in data:
            field = ".".join(path) or "<root>"
            raise InputError(
                f"{field}: holds a NUL character, which no path, environment variable or argument can carry "
                f"(got {excerpt(data)})",
                where=source,
            )
    elif isinstance(data, Mapping):
        for key, value in data.items():
            check_no_nul(key, source, path)
            check_no_nul(value, source, (*path, str(key)))
    elif isinstance(data, list | tuple):
        for i, value in enumerate(data):
            check_no_nul(value, source, (*path, str(i)))


def _strings(data: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """(field, string) for every string of a spec's data, keys included."""
    if isinstance(data, str):
        yield ".".join(path) or "<root>", data
    elif isinstance(data, Mapping):
        for key, value in data.items():
            yield from _strings(key, path)
            yield from _strings(value, (*path, str(key)))
    elif isinstance(data, list | tuple):
        for i, value in enumerate(data):
            yield from _strings(value, (*path, str(i)))


def check_locale(spec: Any, source: str) -> None:
    """Every string of the spec (paths, ``file:`` prompts, drafters, env values) is one this process can hand to
    the OS and to Ray: under a non-UTF-8 locale (``LC_ALL=C`` with ``PYTHONUTF8=0``) a non-ASCII path cannot be
    encoded, and a ``stat``, an ``os.environ`` or ``ray.init`` would end in a UnicodeEncodeError. Refused before
    anything touches a file, naming the field and the filesystem encoding."""
    encoding = sys.getfilesystemencoding()
    for field, value in _strings(spec.model_dump(mode="python")):
        try:
            os.fsencode(value)
            value.encode("utf-8")
        except UnicodeEncodeError:
            shown = "its value" if field.startswith("env.") else excerpt(value)  # env values stay unprinted
            raise InputError(
                f"{field}: {shown} cannot be encoded in this locale's filesystem encoding ({encoding}); "
                "run under a UTF-8 locale (LC_ALL=C.UTF-8 or PYTHONUTF8=1) or use an ASCII name",
                where=source,
            ) from None


def how_many(n: int) -> str:
    """A count for a message: exact when short, else its order of magnitude (never thousands of digits)."""
    if n < 10**15:
        return f"{n:,}"
    return f"about 10^{int(n.bit_length() * 0.30103)}"


def check_concurrency(spec: Any) -> None:
    """No concurrency above ``workload.requests``: at most that many requests are ever in flight, so the cell
    would be measured at a lower concurrency than its label (InputError naming both fields)."""
    requests = spec.workload.requests
    above = [c for c in spec.concurrency if c > requests]
    if above:
        raise InputError(
            f"c = {', '.join(how_many(c) for c in above)} is above workload.requests = {requests:,}: at most "
            f"{requests:,} requests are ever in flight, so such a cell would be measured at c = {requests:,} and "
            f"labelled c = {how_many(above[0])}. Fix: raise workload.requests to at least {how_many(max(above))} "
            f"or keep concurrency at most {requests:,}",
            where="concurrency",
        )


#: The most positions one request may need (prompt + max_new_tokens + B), whatever the engine: beyond every
#: released model's context (the longest are ~10M tokens), so no engine's memory pre-check can hold it.
MAX_REQUEST_TOKENS = 2**24


def check_token_counts(spec: Any) -> None:
    """Token counts no model can hold, refused for every engine before any model is known (InputError naming the
    field and :data:`MAX_REQUEST_TOKENS`); a known model's own positions are its engine's check."""
    max_new, block = generation_tokens(spec)
    wl = spec.workload
    prompt = max(2, wl.prompt_tokens) if wl.prompts == "synthetic" else 0
    if prompt + max_new + block > MAX_REQUEST_TOKENS:
        field = "workload.max_new_tokens" if max_new >= prompt else "workload.prompt_tokens"
        raise InputError(
            f"a request would need {how_many(prompt + max_new + block)} positions (prompt {how_many(prompt)} + "
            f"max_new_tokens {how_many(max_new)} + block {block}), more than {MAX_REQUEST_TOKENS:,}, beyond any "
            "model's context and any memory pre-check: lower it",
            where=field,
        )


def generation_tokens(spec: Any) -> tuple[int, int]:
    """(max_new_tokens, block) of the spec's cell that needs the most positions past its prompt: a speculative
    cell's verify block writes up to B positions past what it has committed, an autoregressive one none."""
    from pd_dflash.baselines import BLOCK_INDEPENDENT, SPECULATIVE  # spec.py imports this module

    wl, largest = spec.workload, max(spec.block_sizes)
    pairs = [
        # as spec.iter_cells resolves it: a block-independent row stands for the largest block
        (
            wl.resolve_max_new_tokens(largest if name in BLOCK_INDEPENDENT else b),
            b if name in SPECULATIVE else 0,
        )
        for name in spec.baselines
        for b in spec.block_sizes
    ]
    return max(pairs, key=sum)


def positions_problem(
    longest_prompt: int,
    max_new_tokens: int,
    block: int,
    positions: int,
    *,
    model: str,
    bound: str,
    lower: bool,
) -> str | None:
    """Why a cell cannot stay inside the model's positions (its prompt + ``max_new_tokens`` + the verify block
    ``block``, 0 for autoregressive decoding), or None. ``bound`` names where ``positions`` comes from;
    ``lower``: the prompt length is a lower bound (its own tokens, before the chat template adds its own)."""
    need = longest_prompt + max_new_tokens + block
    if need <= positions:
        return None
    prompt = f"{'at least ' if lower else ''}{longest_prompt:,} tokens"
    verify = f" + the verify block (B = {block})" if block else ""
    return (
        f"{model}: the longest prompt ({prompt}) + workload.max_new_tokens ({max_new_tokens:,}){verify} needs "
        f"{need:,} positions, more than the model's {positions:,} ({bound}). Fix: shorten the prompts "
        "(workload.prompt_tokens, workload.prompts) or lower workload.max_new_tokens or the block sizes"
    )


def prompt_file(source: str) -> Path | None:
    """The file a ``workload.prompts`` value names (``file:PATH`` or a plain path); None for the built-ins."""
    if source in ("synthetic", "humaneval"):
        return None
    return Path(source[len("file:") :] if source.startswith("file:") else source).expanduser()


# -- what this machine can say ------------------------------------------------------------------------------


def check_prompt_file(source: str) -> None:
    """The prompt file exists here, is a regular file and can be opened (InputError naming it otherwise)."""
    path = prompt_file(source)
    if path is None:
        return
    if not path.exists():
        raise InputError(f"prompt file {path} does not exist", where="workload.prompts")
    if not path.is_file():
        raise InputError(f"prompt file {path} is not a regular file", where="workload.prompts")
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise InputError(
            f"cannot read prompt file {path}: {exc.strerror or exc}", where="workload.prompts"
        ) from None


def memory_figures() -> tuple[int | None, int | None]:
    """(total, available) bytes of this machine's memory from ``/proc/meminfo`` (None where unreadable)."""
    found: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found.get("MemTotal"), found.get("MemAvailable")


def local_memory_problem(object_store_mb: int, total: int | None, available: int | None) -> str | None:
    """Why local mode's object store of ``object_store_mb`` MiB cannot start on a machine with these figures
    (Ray needs the object store plus ``RAY_MIN_TASK_MEMORY`` for tasks), or None."""
    wanted = object_store_mb * 2**20
    for figure, what in ((total, "has"), (available, "has available")):
        if figure is not None and wanted + RAY_MIN_TASK_MEMORY > figure:
            return (
                f"local mode's object store of {object_store_mb:,} MiB (+ {RAY_MIN_TASK_MEMORY // 10**6} MB Ray "
                f"keeps for tasks) does not fit: this machine {what} {figure / 2**20:,.0f} MiB of memory; lower "
                "local.object_store_mb"
            )
    return None


def check_here(spec: Any) -> None:
    """``plan`` and ``run``: the files and figures of a ``SweepSpec`` that this machine can check (InputError;
    ``spec`` is untyped here because ``spec.py`` imports this module)."""
    check_prompt_file(spec.workload.prompts)
    # Against the total only: what is available changes by the minute (local mode checks it when it starts).
    problem = local_memory_problem(spec.local.object_store_mb, memory_figures()[0], None)
    if problem:
        raise InputError(problem, where="local.object_store_mb")


def check_local_start(spec: Any) -> None:
    """Before local mode starts Ray: the object store fits what is available now (not Ray's ValueError)."""
    total, available = memory_figures()
    problem = local_memory_problem(spec.local.object_store_mb, total, available)
    if problem:
        raise InputError(problem, where="local.object_store_mb")
