"""`pd-dflash overlap` against CSV fixtures that reproduce upstream's canonical BM4 run (offloaded gpt-oss-20b, B=16).

Canonical figures: 18,180,873,000 H2D bytes over 833 memcpys, 980,204,000 of them overlapped by the compute
ranges → overlap_fraction 0.053914022720471126; at the probed 57,553,826,518.35307 B/s the overlapped bytes
are 0.017031083062521088 s of overlap_with_prev_verify.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_dflash.cli import main
from pd_dflash.errors import InputError
from pd_dflash.overlap import Memcpy, NvtxRange, compute_overlap, overlap_report, read_memcpys

GPU_HEADER = [
    "Start (ns)", "Duration (ns)", "CorrId", "GrdX", "GrdY", "GrdZ", "BlkX", "BlkY", "BlkZ", "Reg/Trd",
    "StcSMem (MB)", "DymSMem (MB)", "Bytes (MB)", "Throughput (MB/s)", "SrcMemKd", "DstMemKd", "Device", "Ctx",
    "GreenCtx", "Strm", "Name",
]  # fmt: skip
NVTX_HEADER = [
    "Start (ns)", "End (ns)", "Duration (ns)", "DurChild (ns)", "DurNonChild (ns)", "Name", "PID", "TID", "Lvl",
    "NumChild", "RangeId", "ParentId", "RangeStack", "NameTree",
]  # fmt: skip
H2D_OLD, H2D_NEW, D2H = "[CUDA memcpy HtoD]", "[CUDA memcpy Host-to-Device]", "[CUDA memcpy Device-to-Host]"

CANONICAL_TOTAL = 18_180_873_000
CANONICAL_OVERLAPPED = 980_204_000
CANONICAL_FRACTION = 0.053914022720471126
CANONICAL_BW = 57_553_826_518.35307
CANONICAL_OVERLAP_SECONDS = 0.017031083062521088


def _memcpy(start: int, duration: int, mb: str, name: str) -> list[str]:
    row = [""] * len(GPU_HEADER)
    row[0], row[1], row[12], row[-1] = str(start), str(duration), mb, name
    return row


def _range(start: int, end: int, name: str) -> list[str]:
    row = [""] * len(NVTX_HEADER)
    row[0], row[1], row[2], row[5] = str(start), str(end), str(end - start), name
    return row


def write_canonical(tmp_path: Path, *, preamble: bool = True) -> tuple[Path, Path]:
    """833 H2D memcpys totalling 18,180.873 MB, of which exactly 980.204 MB are hidden by compute ranges."""
    gpu = [
        _memcpy(5_000, 10_000, "1000.000", H2D_NEW),  # half inside draft∪verify: 500,000,000 hidden
        _memcpy(12_000, 26_000, "400.204", H2D_OLD),  # spans the draft→verify boundary, all hidden
        _memcpy(105_000, 0, "80.000", H2D_NEW),  # instant copy inside the router range: fully hidden
        _memcpy(50_000, 0, "10.000", H2D_NEW),  # instant copy outside every range
        _memcpy(210_000, 80_000, "20.000", H2D_NEW),  # inside expert_h2d: an issue range, hides nothing
        _memcpy(410_000, 80_000, "30.000", H2D_NEW),  # inside a named-domain range: not a compute range
        _memcpy(20_000, 10_000, "999.000", D2H),  # device-to-host: not counted at all
        _memcpy(2_000_000, 5_000, "1,158.267", H2D_NEW),  # nsys's thousands separator
    ]
    gpu += [_memcpy(3_000_000 + i * 10_000, 5_000, "18.000", H2D_OLD) for i in range(825)]
    gpu.append(_memcpy(20_000_000, 5_000, "632.402", H2D_NEW))
    kernel = [""] * len(GPU_HEADER)
    kernel[0], kernel[1], kernel[-1] = "11000", "500", "void expert_gemm<...>(...)"
    gpu.append(kernel)
    nvtx = [
        _range(10_000, 20_000, ":dflash_draft"),
        _range(15_000, 40_000, ":target_verify"),
        _range(16_000, 30_000, ":target_verify"),  # nested duplicate: the union counts it once
        _range(100_000, 110_000, ":route_ahead_router"),
        _range(200_000, 300_000, ":expert_h2d"),
        _range(400_000, 500_000, "CCCL:target_verify"),
        _range(600_000, 700_000, ":route_ahead_issue"),
    ]
    gpu_path, nvtx_path = tmp_path / "bm4_cuda_gpu_trace.csv", tmp_path / "bm4_nvtx_pushpop_trace.csv"
    for path, header, rows in ((gpu_path, GPU_HEADER, gpu), (nvtx_path, NVTX_HEADER, nvtx)):
        with path.open("w", newline="") as fh:
            if preamble:
                fh.write("Processing [bm4.sqlite] with [cuda_gpu_trace.py]... \n\n")
            writer = csv.writer(fh, quoting=csv.QUOTE_ALL)
            writer.writerow(header)
            writer.writerows(rows)
    return gpu_path, nvtx_path


def test_canonical_overlap_arithmetic(tmp_path):
    gpu, nvtx = write_canonical(tmp_path)
    report = overlap_report(gpu, nvtx)
    assert report["benchmark"] == "BM4"
    assert report["num_memcpys"] == 833
    assert report["total_h2d_bytes"] == CANONICAL_TOTAL
    assert report["overlapped_h2d_bytes"] == CANONICAL_OVERLAPPED
    assert report["exposed_fetch_bytes"] == CANONICAL_TOTAL - CANONICAL_OVERLAPPED == 17_200_669_000
    assert report["overlap_fraction"] == pytest.approx(CANONICAL_FRACTION, rel=1e-12)
    assert round(report["overlap_fraction"], 4) == 0.0539
    assert report["compute_ranges"] == ["dflash_draft", "route_ahead_router", "target_verify"]
    assert report["rep"] == str(tmp_path / "bm4")
    assert "overlap_with_prev_verify_seconds" not in report
    totals = report["range_totals"]
    assert totals["target_verify"] == {"count": 2, "seconds": pytest.approx(39e-6)}
    assert totals["CCCL:target_verify"]["count"] == 1


def test_overlap_seconds_from_measured_bandwidth(tmp_path):
    gpu, nvtx = write_canonical(tmp_path)
    report = overlap_report(gpu, nvtx, h2d_gbps=CANONICAL_BW / 1e9)
    assert report["overlap_with_prev_verify_seconds"] == pytest.approx(CANONICAL_OVERLAP_SECONDS, rel=1e-12)
    assert report["h2d_bytes_per_second"] == pytest.approx(CANONICAL_BW)


def test_cli_writes_upstream_keys(tmp_path, capsys):
    gpu, nvtx = write_canonical(tmp_path, preamble=False)
    out = tmp_path / "bm4.json"
    rc = main(["overlap", "--gpu-trace", str(gpu), "--nvtx-trace", str(nvtx), "--h2d-gbps", "57.55382651835307",
               "--output", str(out)])  # fmt: skip
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed
    upstream_keys = {"benchmark", "rep", "total_h2d_bytes", "overlapped_h2d_bytes", "overlap_fraction",
                     "exposed_fetch_bytes", "num_memcpys", "compute_ranges"}  # fmt: skip
    assert upstream_keys <= printed.keys()
    assert printed["overlap_with_prev_verify_seconds"] == pytest.approx(CANONICAL_OVERLAP_SECONDS, rel=1e-12)


def test_rep_runs_nsys_stats_and_reads_its_exports(tmp_path, monkeypatch, capsys):
    """--rep calls `nsys stats` like upstream; a stand-in nsys on PATH writes the two CSV exports."""
    made = tmp_path / "made"
    made.mkdir()
    gpu, nvtx = write_canonical(made)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nsys = bin_dir / "nsys"
    nsys.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {tmp_path}/nsys-args\n'
        'for a in "$@"; do case "$a" in --output=*) prefix="${a#--output=}";; esac; done\n'
        f'cp {gpu} "${{prefix}}_cuda_gpu_trace.csv"; cp {nvtx} "${{prefix}}_nvtx_pushpop_trace.csv"\n'
    )
    nsys.chmod(0o755)
    rep = tmp_path / "bm4.nsys-rep"
    rep.write_bytes(b"not really a report")
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    assert main(["overlap", "--rep", str(rep)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["overlapped_h2d_bytes"] == CANONICAL_OVERLAPPED and printed["rep"] == str(tmp_path / "bm4")
    args = (tmp_path / "nsys-args").read_text()
    assert "stats" in args and "--report=cuda_gpu_trace" in args and "--report=nvtx_pushpop_trace" in args
    assert "--format=csv" in args and str(rep) in args
    nsys.write_text("#!/bin/sh\necho 'broken report' >&2\nexit 3\n")
    (tmp_path / "bm4_cuda_gpu_trace.csv").unlink()
    assert main(["overlap", "--rep", str(rep)]) == 2
    assert "nsys stats failed (exit 3): broken report" in capsys.readouterr().err


def test_rep_needs_nsys_and_excludes_csv_inputs(tmp_path, monkeypatch, capsys):
    rep = tmp_path / "x.nsys-rep"
    rep.write_bytes(b"")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["overlap", "--rep", str(rep)]) == 2
    assert "nsys is not on PATH" in capsys.readouterr().err
    assert main(["overlap", "--rep", str(rep), "--gpu-trace", "a.csv"]) == 2
    assert main(["overlap", "--gpu-trace", "a.csv"]) == 2
    assert "needs --rep" in capsys.readouterr().err


def test_custom_compute_ranges_match_with_or_without_colon(tmp_path):
    gpu, nvtx = write_canonical(tmp_path)
    only_issue = overlap_report(gpu, nvtx, compute_ranges=[":expert_h2d"])
    assert only_issue["overlapped_h2d_bytes"] == 20_000_000
    named = overlap_report(gpu, nvtx, compute_ranges=["CCCL:target_verify"])
    assert named["overlapped_h2d_bytes"] == 30_000_000


def test_bytes_are_exact_decimal(tmp_path):
    gpu, _ = write_canonical(tmp_path)
    sizes = [m.nbytes for m in read_memcpys(gpu)]
    assert 400_204_000 in sizes and 1_158_267_000 in sizes  # float(400.204) * 1e6 would give 400203999.99...


def test_no_bytes_gives_zero_fraction():
    result = compute_overlap([], [NvtxRange(":target_verify", 0, 10)])
    assert result["overlap_fraction"] == 0.0 and result["total_h2d_bytes"] == 0


def test_errors_name_the_file(tmp_path):
    gpu, nvtx = write_canonical(tmp_path)
    with pytest.raises(InputError, match=r"missing\.csv"):
        overlap_report(tmp_path / "missing.csv", nvtx)
    bad = tmp_path / "bad.csv"
    bad.write_text("just,some,words\n1,2,3\n")
    with pytest.raises(InputError, match="no header row"):
        overlap_report(bad, nvtx)
    broken = tmp_path / "broken_cuda_gpu_trace.csv"
    broken.write_text(gpu.read_text().replace('"632.402"', '"6x2"'))
    with pytest.raises(InputError, match=r"broken_cuda_gpu_trace.csv:\d+"):
        overlap_report(broken, nvtx)


def test_cli_exit_code_on_bad_input(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pd_dflash", "overlap", "--gpu-trace", str(tmp_path / "nope.csv"),
         "--nvtx-trace", str(tmp_path / "nope2.csv")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "nope" in proc.stderr and "cannot read" in proc.stderr


spans = st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 200)), max_size=6)


@settings(max_examples=150, deadline=None)
@given(
    copies=st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 200), st.integers(1, 10**9)), max_size=8),
    ranges=spans,
)
def test_overlap_is_a_fraction_and_duplicates_do_not_count(copies, ranges):
    memcpys = [Memcpy(s, s + d, b) for s, d, b in copies]
    nvtx = [NvtxRange(":target_verify", s, s + d) for s, d in ranges]
    once = compute_overlap(memcpys, nvtx)
    twice = compute_overlap(memcpys, nvtx + [NvtxRange(":dflash_draft", r.start_ns, r.end_ns) for r in nvtx])
    assert 0.0 <= once["overlap_fraction"] <= 1.0
    assert once["overlapped_h2d_bytes"] <= once["total_h2d_bytes"] + 1e-6
    assert twice["overlapped_h2d_bytes"] == pytest.approx(once["overlapped_h2d_bytes"])
