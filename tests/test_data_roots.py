"""File datasets are read only under the operator's data roots: refused at submit, checked again on the worker."""

import httpx
import pydantic
import pytest

from models.data import build_dataset
from models.data_roots import check_submitted_path, resolve_confined
from tests.handmade import spec_dict
from tula_service.spec.job_spec import JobSpec


def _folder_of_images(root):
    from PIL import Image

    for label in ("cats", "dogs"):
        (root / label).mkdir(parents=True)
        Image.new("RGB", (6, 6)).save(root / label / "a.png")
    return root


def test_without_a_data_root_file_datasets_are_off_and_the_message_says_how_to_allow_one():
    message = check_submitted_path("/data/images", [])
    assert "no data root is configured" in message and "tula serve --data-root /data" in message


@pytest.mark.parametrize(("path", "says"), [
    ("images", "must be absolute"),
    ("/data/../etc", "must not contain '..'"),
    ("/etc", "outside the data roots (/data)"),
    ("/database", "outside the data roots"),  # a prefix of the string is not a folder under the root
])  # fmt: skip
def test_paths_outside_a_root_are_refused_at_submit(path, says):
    assert says in check_submitted_path(path, ["/data"])


def test_paths_under_a_root_are_accepted():
    assert check_submitted_path("/data", ["/data"]) is None
    assert check_submitted_path("/data/./cifar/train", ["/srv", "/data/"]) is None


def test_a_spec_with_a_path_outside_the_roots_is_refused_at_dataset_path(monkeypatch):
    monkeypatch.setenv("TULA_DATA_ROOTS", "/data")
    dataset = {"name": "token_file", "path": "/etc/passwd", "num_samples": 1000}
    with pytest.raises(pydantic.ValidationError) as caught:
        JobSpec.model_validate(spec_dict(model="gpt", dataset=dataset))
    [error] = caught.value.errors()
    assert error["loc"] == ("dataset", "path") and "outside the data roots (/data)" in error["msg"]


def test_the_worker_refuses_a_symlink_that_leads_out_of_a_root(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "passwd").symlink_to("/etc/passwd")
    with pytest.raises(PermissionError, match="leads outside the data roots"):
        resolve_confined(str(root / "passwd"), [str(root)])
    with pytest.raises(PermissionError, match="outside the data roots"):
        build_dataset("token_file", path="/etc/passwd", seq_len=8, data_roots=[str(root)])


def test_the_worker_refuses_an_image_folder_with_images_linked_from_outside(tmp_path):
    root = _folder_of_images(tmp_path / "data" / "pets")
    outside = _folder_of_images(tmp_path / "elsewhere")
    (root / "cats" / "b.png").symlink_to(outside / "cats" / "a.png")
    with pytest.raises(PermissionError, match="1 of its images are symlinks that lead out of the folder"):
        build_dataset("image_folder", path=str(root), image_size=8, data_roots=[str(tmp_path / "data")])


def test_the_worker_reads_a_folder_under_its_root(tmp_path):
    root = _folder_of_images(tmp_path / "data" / "pets")
    data = build_dataset("image_folder", path=str(root), image_size=8, data_roots=[str(tmp_path / "data")])
    assert data.num_classes == 2


def test_an_empty_folder_error_does_not_list_what_is_in_it(tmp_path):
    (tmp_path / "secret-project").mkdir()
    with pytest.raises(FileNotFoundError) as caught:
        build_dataset("image_folder", path=str(tmp_path), data_roots=[str(tmp_path)])
    assert "secret-project" not in str(caught.value)


def test_the_api_refuses_a_path_when_no_root_is_configured(live_server):
    spec = spec_dict(dataset={"name": "image_folder", "path": "/etc", "num_samples": 1000})
    response = httpx.post(f"{live_server.url}/v1/jobs", json=spec, timeout=30)
    assert response.status_code == 422
    [error] = response.json()["errors"]
    assert error["field"] == "body.dataset.path" and "--data-root" in error["message"]


def test_tula_serve_data_root_allows_paths_under_it_only(make_server, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    server = make_server("--executor", "none", "--data-root", str(root))
    inside = spec_dict(model="gpt", dataset={"name": "token_file", "path": str(root / "corpus.bin"), "num_samples": 1000})
    assert httpx.post(f"{server.url}/v1/jobs", json=inside, timeout=30).status_code == 202
    outside = spec_dict(model="gpt", dataset={"name": "token_file", "path": "/etc/passwd", "num_samples": 1000})
    response = httpx.post(f"{server.url}/v1/jobs", json=outside, timeout=30)
    assert response.status_code == 422 and f"outside the data roots ({root})" in response.json()["errors"][0]["message"]
    assert f"Data roots:     {root}" in server.log_path.read_text()
