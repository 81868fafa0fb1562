"""Joining a cluster whose address is malformed or does not answer (issue 22, defect 12): a bounded wait, then
exit 2 naming the address and where it came from (--address or $RAY_ADDRESS); never a hang or a Ray traceback.
No cluster is started here: the addresses are made not to answer."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from pd_dflash.cli import build_parser
from pd_dflash.errors import InputError
from pd_dflash.sweep.cli import options_from_args
from pd_dflash.sweep.connect import DEFAULT_CONNECT_TIMEOUT_S, parse_address, reach
from tests.sweep.helpers import run_cli, spec_data, write_spec

MALFORMED = [
    "foo bar",
    "10.0.0.1",
    "10.0.0.1:",
    ":6379",
    "10.0.0.1:0",
    "10.0.0.1:65536",
    "10.0.0.1:http",
    "ray://",
    "http://10.0.0.1:6379/x",
    "10.0.0.1:6379 extra",
    "",
]


@pytest.mark.parametrize("text", MALFORMED)
@pytest.mark.parametrize("source", ["--address", "RAY_ADDRESS"])
def test_a_malformed_address_is_named_with_its_source(text, source):
    with pytest.raises(InputError) as err:
        parse_address(text, source)
    assert err.value.where == source and f"malformed Ray cluster address {text!r}" in str(err.value)


def test_a_dashboard_url_is_named_as_one():
    with pytest.raises(InputError, match="an http\\(s\\) address is a dashboard's"):
        parse_address("http://10.0.0.1:8265", "RAY_ADDRESS")


@pytest.mark.parametrize(
    ("text", "endpoint"),
    [
        ("10.0.0.1:6379", ("10.0.0.1", 6379)),
        ("ray://head:10001", ("head", 10001)),
        ("[::1]:6379", ("::1", 6379)),
        (" head.example:6380 ", ("head.example", 6380)),
        ("auto", None),
    ],
)
def test_well_formed_addresses_parse(text, endpoint):
    assert parse_address(text, "--address").endpoint == endpoint


def test_the_wait_is_30_s_by_default_and_an_option():
    args = build_parser().parse_args(["run", "s.yaml", "--out", "o"])
    assert options_from_args(args).connect_timeout_s == DEFAULT_CONNECT_TIMEOUT_S == 30.0
    args = build_parser().parse_args(["run", "s.yaml", "--out", "o", "--connect-timeout", "2.5"])
    assert options_from_args(args).connect_timeout_s == 2.5
    for bad in ("0", "-1", "nan", "inf", "1e308"):  # refused at parse, its bounds named (test_cli_bounds)
        with pytest.raises(SystemExit):
            build_parser().parse_args(["run", "s.yaml", "--out", "o", "--connect-timeout", bad])
    args.connect_timeout = float("inf")  # a Namespace built by hand is checked again
    with pytest.raises(InputError) as err:
        options_from_args(args)
    assert err.value.where == "--connect-timeout"


@contextlib.contextmanager
def listener(behaviour: str):
    """A local port that accepts connections and then says nothing, or closes them, or talks HTTP/1."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.2)
    stop = threading.Event()
    held = []

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            if behaviour == "close":
                conn.close()
            elif behaviour == "http1":
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                held.append(conn)
            else:
                held.append(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(2)
        for conn in held:
            conn.close()
        server.close()


@pytest.mark.parametrize("behaviour", ["silent", "close", "http1"])
def test_a_port_that_is_not_a_ray_gcs_is_refused_within_the_wait(behaviour):
    with listener(behaviour) as address:
        started = time.monotonic()
        with pytest.raises(InputError) as err:
            reach(parse_address(address, "--address"), 1.5)
        assert time.monotonic() - started < 1.5 + 6
    assert repr(address) in str(err.value) and "(from --address)" in str(err.value)


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_run_with_an_address_that_does_not_answer_exits_2_naming_it(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", spec_data())
    for address in ("127.0.0.1:1", f"127.0.0.1:{closed_port()}"):
        started = time.monotonic()
        proc = run_cli(
            "run",
            str(spec),
            "--out",
            str(tmp_path / "out"),
            "--address",
            address,
            "--connect-timeout",
            "2",
            timeout=60,
        )
        took = time.monotonic() - started
        said = proc.stdout + proc.stderr
        assert proc.returncode == 2 and "Traceback" not in said, said
        assert f"the Ray cluster at {address!r} (from --address) does not answer" in proc.stderr
        assert took < 30, took  # interpreter start + 2 s, never Ray's minutes of retries
        assert not (tmp_path / "out" / "rows.jsonl").exists()


def test_run_with_a_silent_address_from_the_environment_exits_2_naming_ray_address(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", spec_data())
    with listener("silent") as address:
        proc = run_cli(
            "run",
            str(spec),
            "--out",
            str(tmp_path / "out"),
            "--connect-timeout",
            "2",
            env={"RAY_ADDRESS": address},
            timeout=60,
        )
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert f"the Ray cluster at {address!r} (from RAY_ADDRESS)" in proc.stderr


@pytest.mark.parametrize("value", ["not an address", "10.0.0.1:notaport", "ray://:10001"])
def test_run_with_a_malformed_ray_address_exits_2_naming_it(tmp_path, value):
    spec = write_spec(tmp_path / "spec.yaml", spec_data())
    proc = run_cli("run", str(spec), "--out", str(tmp_path / "out"), env={"RAY_ADDRESS": value}, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert f"RAY_ADDRESS: malformed Ray cluster address {value!r}" in proc.stderr
