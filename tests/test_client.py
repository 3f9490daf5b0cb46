"""The typed Python client against a real API-only server (jobs are stored, never profiled)."""

import socket
import threading
import uuid

import httpx
import pytest
from pydantic import ValidationError

from tests.api_fixtures import finished_job, store_for
from tests.handmade import measurement, spec_dict
from tula_service.client import TulaClient, TulaError
from tula_service.plan.recommend import plan
from tula_service.plan.recommendation import JobRecommendation, WhatIfPlan
from tula_service.schemas import JobList, JobView, MeasurementList, PointList
from tula_service.spec.job_spec import JobSpec


@pytest.fixture
def client(api_only):
    with TulaClient(api_only.url, backoff_s=0.01) as client:
        yield client


def unique_spec(**overrides) -> dict:
    return spec_dict(name=f"client-{uuid.uuid4().hex[:8]}", **overrides)


def jobs_named(client: TulaClient, name: str) -> list[JobView]:
    return [job for job in client.iter_jobs() if job.name == name]


class FlakyProxy:
    """A TCP proxy in front of the server that spoils its first `spoil` connections, then relays.

    drop: forward the request, wait until the server answers, and close without relaying the
    answer (the server did the work; the client never heard). unavailable: answer 503 itself.
    """

    def __init__(self, upstream_port: int, mode: str, spoil: int = 1):
        self.upstream_port = upstream_port
        self.mode = mode
        self.spoil = spoil
        self.requests: list[bytes] = []  # the head of every request that reached the proxy
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(downstream,), daemon=True).start()

    def _handle(self, downstream: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        request = _read_request(downstream)
        self.requests.append(request)
        if len(self.requests) <= self.spoil:
            if self.mode == "unavailable":
                downstream.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            else:
                upstream.sendall(request)
                upstream.recv(1)  # the server answered: the job exists now
            downstream.close()
            upstream.close()
            return
        upstream.sendall(request)
        threading.Thread(target=_pipe, args=(downstream, upstream), daemon=True).start()
        _pipe(upstream, downstream)

    def close(self) -> None:
        self._listener.close()


def _read_request(connection: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += connection.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += connection.recv(65536)
    return head + b"\r\n\r\n" + body


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def idempotency_key(request: bytes) -> str:
    for line in request.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"idempotency-key":
            return value.strip().decode()
    raise AssertionError(f"no Idempotency-Key in {request[:300]!r}")


def test_responses_are_the_api_models(client):
    job = client.submit(unique_spec(batch_sizes=[8, 16, 32]))
    assert isinstance(job, JobView) and job.state == "queued" and job.progress.points_total == 3
    assert client.job(job.id) == job
    page = client.jobs(limit=1)
    assert isinstance(page, JobList) and page.jobs[0].id == job.id and page.total >= 1
    measurements = client.measurements(job.id)
    assert isinstance(measurements, MeasurementList) and [p.batch_size for p in measurements.points] == [8, 16, 32]
    assert "small_cnn" in {model["name"] for model in client.catalog("models")["models"]}
    assert client.ready()["status"] == "ready"


def test_points_come_a_page_at_a_time_as_the_job_view_embeds_them(client):
    job = client.submit(unique_spec(batch_sizes=[8, 16, 32]))
    first = client.points(job.id, limit=2)
    assert isinstance(first, PointList) and first.total == 3 and first.next_offset == 2
    last = client.points(job.id, limit=2, offset=first.next_offset)
    assert last.next_offset is None and first.points + last.points == job.points
    with pytest.raises(TulaError) as refused:
        client.points("nope")
    assert refused.value.status_code == 404 and "job 'nope' not found" in refused.value.message


def test_iter_jobs_pages_through_every_job(client):
    for _ in range(5):
        client.submit(unique_spec())
    every = client.jobs(limit=500)
    paged = [job.id for job in client.iter_jobs(page_size=2)]
    assert every.total >= 5 and len(paged) == every.total and len(set(paged)) == every.total
    assert paged == [job.id for job in every.jobs]


def test_iter_jobs_filters_by_state(client):
    job = client.submit(unique_spec())
    client.cancel(job.id)
    cancelled = list(client.iter_jobs(states="cancelled", page_size=1))
    assert job.id in {j.id for j in cancelled} and {j.state for j in cancelled} == {"cancelled"}


def test_the_same_key_twice_is_one_job(client):
    spec, key = unique_spec(), str(uuid.uuid4())
    first = client.submit(spec, idempotency_key=key)
    again = client.submit(spec, idempotency_key=key)
    assert again.id == first.id and [job.id for job in jobs_named(client, spec["name"])] == [first.id]


def test_the_same_key_with_another_spec_is_a_422(client):
    key = str(uuid.uuid4())
    client.submit(unique_spec(), idempotency_key=key)
    with pytest.raises(TulaError) as refused:
        client.submit(unique_spec(), idempotency_key=key)
    assert refused.value.status_code == 422
    assert refused.value.problem["errors"][0]["field"] == "header.Idempotency-Key"
    assert "header.Idempotency-Key: " in str(refused.value)


def test_a_submission_whose_answer_was_lost_is_retried_without_a_second_job(api_only):
    proxy = FlakyProxy(api_only.port, "drop")
    spec = unique_spec()
    with TulaClient(proxy.url, backoff_s=0.01) as flaky, TulaClient(api_only.url) as direct:
        job = flaky.submit(spec)
        assert len(proxy.requests) == 2 and idempotency_key(proxy.requests[0]) == idempotency_key(proxy.requests[1])
        assert [j.id for j in jobs_named(direct, spec["name"])] == [job.id]
    proxy.close()


def test_a_503_is_retried(api_only):
    proxy = FlakyProxy(api_only.port, "unavailable", spoil=2)
    with TulaClient(proxy.url, backoff_s=0.01) as flaky:
        assert flaky.submit(unique_spec()).state == "queued"
    assert len(proxy.requests) == 3
    proxy.close()


def test_without_retries_the_transport_error_reaches_the_caller(api_only):
    proxy = FlakyProxy(api_only.port, "drop")
    with TulaClient(proxy.url, retries=0) as flaky, pytest.raises(httpx.TransportError):
        flaky.submit(unique_spec())
    proxy.close()


def test_a_bad_spec_is_a_422_naming_the_field(client):
    with pytest.raises(TulaError) as refused:
        client.submit(unique_spec(pricing={"price": -1}, batch_sizes=[8, 0]))
    lines = str(refused.value).splitlines()
    assert refused.value.status_code == 422 and refused.value.problem["status"] == 422
    assert any(line.startswith("pricing.price: ") and "greater than 0" in line for line in lines)
    assert any(line.startswith("batch_sizes.1: ") for line in lines)
    assert not any(line.startswith("body.") for line in lines[1:])


def test_an_unknown_job_is_a_404_with_the_servers_words(client):
    with pytest.raises(TulaError, match="job 'nope' not found") as missing:
        client.job("nope")
    assert missing.value.status_code == 404 and missing.value.problem["instance"] == "/v1/jobs/nope"


def test_cancel_then_wait_returns_the_cancelled_job(client):
    job = client.submit(unique_spec())
    assert client.cancel(job.id).state == "cancelled"
    seen: list[JobView] = []
    final = client.wait(job.id, poll_s=0.05, timeout_s=30, on_progress=seen.append)
    assert final.state == "cancelled" and seen == [final]


def test_wait_times_out_on_a_job_nobody_runs(client):
    job = client.submit(unique_spec())
    with pytest.raises(TimeoutError, match="still queued"):
        client.wait(job.id, poll_s=0.05, timeout_s=0.2)


def test_delete_removes_the_job(client):
    job = client.submit(unique_spec())
    assert client.delete(job.id) is None
    with pytest.raises(TulaError) as gone:
        client.job(job.id)
    assert gone.value.status_code == 404


def test_recommendation_and_plan_of_an_unfinished_job_are_409s(client):
    job = client.submit(unique_spec())
    for call in (lambda: client.recommendation(job.id), lambda: client.plan(job.id, {"cluster": {"nodes": 2}})):
        with pytest.raises(TulaError) as refused:
            call()
        assert refused.value.status_code == 409 and "queued" in str(refused.value)


def test_a_recommendation_is_the_servers_json_checked_against_its_model(client, api_only):
    job_id = finished_job(store_for(api_only.database_url))
    answer = client.recommendation(job_id)
    assert answer == httpx.get(f"{api_only.url}/v1/jobs/{job_id}/recommendation").json()
    typed = client.recommendation_model(job_id)
    assert isinstance(typed, JobRecommendation) and typed.job_id == job_id
    assert typed.chosen.total_time_s.source == "predicted" and typed.model_dump(mode="json", exclude_unset=True) == answer


def test_a_what_if_plan_is_checked_against_its_model(client, api_only):
    job_id = finished_job(store_for(api_only.database_url))
    answer = client.plan(job_id, {"cluster": {"nodes": 2}, "objective": "min_time"})
    assert answer["what_if"] == {"cluster": {"nodes": 2}, "objective": "min_time"} and answer["objective"] == "min_time"
    typed = client.plan_model(job_id, {"cluster": {"nodes": 2}})
    assert isinstance(typed, WhatIfPlan) and max(row.devices for row in typed.candidates) == 2


def test_an_answer_that_breaks_the_recommendation_contract_is_refused():
    recommendation = plan(JobSpec.model_validate(spec_dict()), [measurement(b) for b in (8, 16, 32)])
    del recommendation["chosen"]["cost_usd"]["source"]
    server = httpx.MockTransport(lambda request: httpx.Response(200, json={"job_id": "j", **recommendation}))
    with TulaClient("http://tula.invalid", transport=server) as broken, pytest.raises(ValidationError, match="cost_usd.source"):
        broken.recommendation("j")


def test_unknown_catalog_is_refused_before_any_request(client):
    with pytest.raises(ValueError, match="known: models, datasets, losses, gpus"):
        client.catalog("optimizers")
