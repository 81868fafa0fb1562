"""The host-memory headroom read from the cgroup leaves out the page cache the kernel can reclaim (issue 22,
item 4): after one runner read a 61 GB checkpoint, its page cache counts in the cgroup's usage, and a second
runner in the same cgroup was refused memory that is free for the taking. Figures injected from a fake cgroup."""

from __future__ import annotations

from pathlib import Path

from pd_dflash.engine.reference.offload.memory import cgroup_headroom, host_available_bytes, meminfo_headroom

GB = 10**9


def cgroup_v2(root: Path, limit: str, current: int, inactive_file: int | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.max").write_text(limit + "\n")
    (root / "memory.current").write_text(f"{current}\n")
    if inactive_file is not None:
        stat = f"anon {current - inactive_file}\nfile {inactive_file}\nactive_file 0\ninactive_file {inactive_file}\n"
        (root / "memory.stat").write_text(stat)
    return root


def meminfo(path: Path, available: int) -> Path:
    path.write_text(f"MemTotal: {512 * GB // 1024} kB\nMemAvailable: {available // 1024} kB\n")
    return path


def test_reclaimable_page_cache_is_headroom(tmp_path):
    # 100 GB limit, 90 GB "used" of which 61 GB is the inactive page cache of a checkpoint read.
    root = cgroup_v2(tmp_path / "cg", str(100 * GB), 90 * GB, 61 * GB)
    assert cgroup_headroom(root) == 71 * GB  # not 10 GB
    info = meminfo(tmp_path / "meminfo", 400 * GB)
    assert host_available_bytes(root, info) == 71 * GB  # the cgroup is the tighter figure


def test_without_memory_stat_usage_counts_in_full(tmp_path):
    root = cgroup_v2(tmp_path / "cg", str(100 * GB), 90 * GB, None)
    assert cgroup_headroom(root) == 10 * GB


def test_no_limit_and_a_usage_over_the_limit(tmp_path):
    assert cgroup_headroom(cgroup_v2(tmp_path / "a", "max", 90 * GB, 61 * GB)) is None
    assert cgroup_headroom(cgroup_v2(tmp_path / "b", str(10 * GB), 12 * GB, 1 * GB)) == 0
    # A stat claiming more cache than the usage cannot make the headroom exceed the limit.
    assert cgroup_headroom(cgroup_v2(tmp_path / "c", str(10 * GB), 2 * GB, 5 * GB)) == 10 * GB
    info = meminfo(tmp_path / "meminfo", 30 * GB)
    assert host_available_bytes(tmp_path / "a", info) == 30 * GB  # no cgroup limit: MemAvailable
    assert host_available_bytes(tmp_path / "none", tmp_path / "absent") is None


def test_cgroup_v1_uses_total_inactive_file(tmp_path):
    mem = tmp_path / "cg" / "memory"
    mem.mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text(f"{64 * GB}\n")
    (mem / "memory.usage_in_bytes").write_text(f"{60 * GB}\n")
    (mem / "memory.stat").write_text(
        f"cache {40 * GB}\ninactive_file {5 * GB}\ntotal_inactive_file {30 * GB}\n"
    )
    assert cgroup_headroom(tmp_path / "cg") == 34 * GB


def test_memtotal_minus_used_counts_where_memavailable_is_low(tmp_path):
    """A VM whose memory grows as used reports a low MemAvailable: MemTotal − used (free(1)'s used) says more."""
    info = tmp_path / "meminfo"
    kb = GB // 1024
    info.write_text(
        f"MemTotal: {128 * kb} kB\nMemFree: {20 * kb} kB\nMemAvailable: {8 * kb} kB\nBuffers: {1 * kb} kB\n"
        f"Cached: {40 * kb} kB\nSReclaimable: {3 * kb} kB\nShmem: {4 * kb} kB\n"
    )
    # used = 128 − 20 − (1 + 40 + 3 − 4) = 68 GB, so 60 GB are free for the taking, not MemAvailable's 8 GB.
    assert meminfo_headroom(info) == 60 * kb * 1024
    assert host_available_bytes(tmp_path / "no-cgroup", info) == 60 * kb * 1024
    # And where MemAvailable says more (a plain host), it is kept.
    info.write_text(f"MemTotal: {128 * kb} kB\nMemFree: {2 * kb} kB\nMemAvailable: {90 * kb} kB\n")
    assert meminfo_headroom(info) == 90 * kb * 1024
