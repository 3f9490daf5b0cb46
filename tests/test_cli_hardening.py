"""No user error makes `tula` print a traceback or hang: each mistake is one `error: ...` and its exit status.

Every test runs the real CLI in a subprocess with a timeout, so a command that hangs fails the test.
"""

import http.server
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import REPO, free_port
from tests.handmade import spec_dict
from tula_service.cli.human import human_bandwidth, human_bytes, human_duration, human_number, human_usd
from tula_service.client import TulaClient
from tula_service.limits import DEFAULT_MAX_REQUEST_BYTES
from tula_service.spec.specfile import MAX_SPEC_BYTES

EXAMPLE = REPO / "configs" / "example_small_cnn.yaml"
NOWHERE = "http://127.0.0.1:9"  # never reached: these mistakes are found before anything is sent


def tula(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tula_service", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )


def refused(result: subprocess.CompletedProcess, message: str) -> bool:
    """Exit 2 with the message on stderr, and no traceback."""
    return result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


# --- spec files: parsed safely, with line and column -------------------------------------------------


def test_invalid_yaml_is_exit_2_with_its_line_and_column(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: x\n  model: small_cnn\n")  # indented by mistake
    result = tula("submit", str(spec), "--server", NOWHERE)
    assert refused(result, f"{spec} line 2, column 8: not YAML: mapping values are not allowed here"), result.stderr


def test_an_unclosed_list_names_where_it_was_opened(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: x\nmodel: small_cnn\nbatch_sizes: [8, 16\ncluster: {nodes: 1}\n")
    result = tula("submit", str(spec), "--server", NOWHERE)
    assert refused(result, f"{spec} line 4, column 8: not YAML: expected ',' or ']'"), result.stderr
    assert "while parsing a flow sequence at line 3, column 14" in result.stderr


def test_a_python_tag_is_refused_by_name_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    spec = tmp_path / "evil.yaml"
    spec.write_text(f'name: x\nmodel: !!python/object/apply:os.system ["touch {marker}"]\n')
    result = tula("submit", str(spec), "--server", NOWHERE)
    assert refused(result, f"{spec} line 2, column 8: the tag '!!python/object/apply:os.system' is not allowed in a spec")
    assert not marker.exists()


@pytest.mark.parametrize(("value", "tag"), [("!!binary aGk=", "!!binary"), ("!!set {a: null}", "!!set"), ("!custom 1", "!custom")])
def test_tags_beyond_plain_data_are_refused_by_name(tmp_path, value, tag):
    spec = tmp_path / "tagged.yaml"
    spec.write_text(f"name: {value}\n")
    assert refused(tula("submit", str(spec), "--server", NOWHERE), f"the tag '{tag}' is not allowed in a spec")


def test_invalid_json_is_exit_2_with_its_line_and_column(tmp_path):
    spec = tmp_path / "bad.json"
    spec.write_text('{\n  "name": "x",\n  "model": small_cnn\n}\n')
    result = tula("submit", str(spec), "--server", NOWHERE)
    assert refused(result, f"{spec} line 3, column 12: not JSON: Expecting value"), result.stderr


def test_nan_is_refused(tmp_path):
    spec = tmp_path / "nan.yaml"
    spec.write_text(EXAMPLE.read_text().replace("price: 2.5", "price: .nan"))
    assert refused(tula("submit", str(spec), "--server", NOWHERE), "'nan' is not allowed in a spec: numbers must be finite")


def test_an_alias_bomb_is_refused_instead_of_expanded(tmp_path):
    levels = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]  # 9**9 strings
    spec = tmp_path / "bomb.yaml"
    spec.write_text("\n".join(levels) + "\n")
    assert refused(tula("submit", str(spec), "--server", NOWHERE, timeout_s=60), "expands to more than")


def test_an_empty_spec_says_so(tmp_path):
    spec = tmp_path / "empty.yaml"
    spec.write_text("# nothing yet\n")
    assert refused(tula("submit", str(spec), "--server", NOWHERE), "a job spec is a mapping of fields, got nothing (the file is empty)")


def test_a_missing_spec_is_exit_2(tmp_path):
    result = tula("submit", str(tmp_path / "nope.yaml"), "--server", NOWHERE)
    assert refused(result, f"cannot read spec {tmp_path / 'nope.yaml'}: No such file or directory")


# --- files refused by kind and size before they are read ---------------------------------------------


def test_dev_zero_is_refused_at_once_as_a_spec_and_as_reference_stats():
    started = time.monotonic()
    assert refused(tula("submit", "/dev/zero", "--server", NOWHERE, timeout_s=30), "/dev/zero is a character device; a spec must be a regular file")
    stats = tula("submit", str(EXAMPLE), "--reference-stats", "/dev/zero", "--server", NOWHERE, timeout_s=30)
    assert refused(stats, "/dev/zero is a character device; a gradient-statistics file must be a regular file")
    assert time.monotonic() - started < 30


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    assert refused(tula("submit", str(fifo), "--server", NOWHERE, timeout_s=30), f"{fifo} is a FIFO (named pipe); a spec must be a regular file")


def test_a_directory_is_refused(tmp_path):
    assert refused(tula("submit", str(tmp_path), "--server", NOWHERE), f"{tmp_path} is a directory; a spec must be a regular file")


def test_a_spec_larger_than_the_servers_request_cap_is_refused_by_size(tmp_path):
    assert MAX_SPEC_BYTES == DEFAULT_MAX_REQUEST_BYTES
    spec = tmp_path / "big.yaml"
    spec.write_text(EXAMPLE.read_text() + "#" * MAX_SPEC_BYTES + "\n")
    assert refused(tula("submit", str(spec), "--server", NOWHERE), f"{spec} is {spec.stat().st_size:,} bytes, more than the 1 MiB limit for a spec")


def test_reference_stats_larger_than_their_limit_are_refused_by_size(tmp_path):
    from tula_service.fit.gradient_stats_file import MAX_FILE_BYTES

    stats = tmp_path / "stats.jsonl"
    with stats.open("wb") as file:
        file.truncate(MAX_FILE_BYTES + 1)  # sparse: nothing is written, and nothing must be read
    result = tula("submit", str(EXAMPLE), "--reference-stats", str(stats), "--server", NOWHERE)
    assert refused(result, f"{stats} is {MAX_FILE_BYTES + 1:,} bytes, more than the 64 MiB limit for a gradient-statistics file"), result.stderr


# --- servers: a bad URL, one that is not there, one that is not Tula ---------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("notaurl", "the server URL 'notaurl' (--server, $TULA_URL) is not http:// or https://"),
        ("ftp://127.0.0.1", "is not http:// or https://"),
        ("http://256.1.1.1:80", "the server URL 'http://256.1.1.1:80' (--server, $TULA_URL) is not a valid URL"),
        (f"http://127.0.0.1:{free_port()}", "cannot reach the Tula server at http://127.0.0.1:"),
    ],
    ids=["no-scheme", "ftp", "bad-address", "refused"],
)
def test_a_bad_or_unreachable_server_is_one_line_and_exit_2(url, message):
    result = tula("catalog", "gpus", "--server", url)
    assert refused(result, message), result.stderr
    assert len(result.stderr.splitlines()) == 1


@pytest.fixture
def not_tula():
    """A real web server that is not Tula: 404 pages in HTML for everything."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_web_server_that_is_not_tula_is_named_not_dumped(not_tula):
    result = tula("show", "abc", "--server", not_tula)
    assert refused(result, f"server answered 404 with an HTML page, not the Tula API's JSON: is {not_tula} a Tula server?")
    assert "<html" not in result.stderr.lower()


def test_a_bad_database_url_is_exit_2():
    result = tula("token", "list", "--database-url", "nonsense")
    assert refused(result, "not a database URL (--database-url, $TULA_DATABASE_URL)"), result.stderr


def test_an_unknown_job_is_one_line_and_exit_2(api_only):
    result = tula("show", "nope", "--server", api_only.url)
    assert refused(result, "server answered 404: job 'nope' not found") and len(result.stderr.splitlines()) == 1


def test_waiting_past_the_timeout_is_exit_124_and_the_job_goes_on(api_only, tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(spec_dict(name="waited-for")))  # an API-only server: the job stays queued
    result = tula("submit", str(spec), "--wait", "--timeout-s", "0.5", "--poll-s", "0.2", "--server", api_only.url)
    assert result.returncode == 124 and "Traceback" not in result.stderr, result.stderr
    job_id = result.stdout.split("submitted job ")[1].split()[0]
    assert f"stopped waiting: job {job_id} still queued after 0.5 s; it goes on (`tula show {job_id}`" in result.stderr


# --- output to a pipe that closes early ---------------------------------------------------------------


def pipeline(command: str, reader: str) -> subprocess.CompletedProcess:
    """`tula COMMAND | READER` in bash with pipefail: the exit status is tula's when the reader's is 0."""
    line = f"set -o pipefail; {sys.executable} -m tula_service {command} | {reader}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # one write per line, as on a terminal: the pipe breaks mid-listing
    return subprocess.run(["bash", "-c", line], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)


def test_head_1_gets_the_first_line_and_no_traceback(api_only):
    result = pipeline(f"catalog models --server {api_only.url}", "head -1")
    assert result.stdout.split() == ["alexnet", "image"]
    assert result.stderr == "" and result.returncode in (0, 141)


def test_head_1_on_more_than_a_pipe_holds_is_exit_141_quietly(api_only):
    with TulaClient(api_only.url) as client:
        for index in range(150):
            client.submit(spec_dict(name=f"queued-{index}"))
    result = pipeline(f"status --json --limit 150 --server {api_only.url}", "head -1")  # about 150 kB: a pipe holds 64 kB
    assert (result.stdout, result.stderr, result.returncode) == ("{\n", "", 141)


def test_a_reader_that_is_gone_before_the_first_line_is_exit_141_quietly(api_only):
    for command in ("catalog models", "catalog gpus", "status"):
        result = pipeline(f"{command} --server {api_only.url}", "true")
        assert (result.returncode, result.stderr) == (141, ""), command


# --- numbers for people ------------------------------------------------------------------------------


def test_the_gpu_catalog_shows_human_units(api_only):
    result = tula("catalog", "gpus", "--server", api_only.url)
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["NAME", "MEMORY", "BANDWIDTH", "BF16", "DENSE", "LINK", "PRICE", "SOURCE"]
    a10g = next(row for row in rows if row.startswith("a10g "))
    assert a10g.split() == ["a10g", "22.5", "GiB", "600", "GB/s", "70", "TFLOPS", "pcie4_x16", "$1.01/GPU-hour", "catalog-assumed"]
    assert "22.48828125" not in result.stdout and "1.006" not in result.stdout


@pytest.mark.parametrize(
    ("shown", "expected"),
    [
        (human_number(22.48828125), "22.5"), (human_number(140.4), "140"), (human_number(40.0), "40"),
        (human_number(12440), "12,440"), (human_bytes(6.43e6), "6.13 MiB"), (human_bytes(1023.9 * 2**20), "1 GiB"),
        (human_bytes(512), "512 B"), (human_bandwidth(12440), "1.55 TB/s"), (human_bandwidth(4800), "600 GB/s"),
        (human_duration(0.3215), "322 ms"), (human_duration(3747), "1.04 h"), (human_duration(3599.9), "1 h"),
        (human_duration(90), "1.5 min"), (human_usd(1.006), "$1.01"), (human_usd(1234.567), "$1,234.57"),
        (human_usd(0.00123), "$0.0012"),
    ],
)  # fmt: skip
def test_human_units(shown, expected):
    assert shown == expected


def test_a_measurements_file_that_is_not_json_is_named_by_its_line():
    """JSONL is parsed a line at a time: its mistake is at the file's line, not at line 1 of the line."""
    from tula_service.cli.client import _json_records
    from tula_service.cli.common import CliError

    with pytest.raises(CliError, match=r"^m\.jsonl: not valid JSON at line 3, column 10: Expecting value$"):
        _json_records("m.jsonl", '{"kind": "step"}\n\n{"kind": }\n')
    with pytest.raises(CliError, match=r"^m\.json: not valid JSON at line 2, column 1: Expecting value$"):
        _json_records("m.json", '[{"kind": "step"},\n]')
    assert _json_records("m.jsonl", '{"kind": "step"}\n\n{"kind": "comm"}\n') == [{"kind": "step"}, {"kind": "comm"}]
