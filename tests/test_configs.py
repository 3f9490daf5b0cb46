"""Every example in configs/ is a valid spec; the JSON twin (for curl) says what the YAML says."""

import json

import pytest
import yaml

from tests.conftest import REPO
from tula_service.spec.job_spec import JobSpec

CONFIGS = sorted((REPO / "configs").glob("example_*.*"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_is_a_valid_spec(path):
    data = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    JobSpec.model_validate(data)


def test_json_example_matches_the_yaml_example():
    yaml_spec = yaml.safe_load((REPO / "configs" / "example_small_cnn.yaml").read_text())
    json_spec = json.loads((REPO / "configs" / "example_small_cnn.json").read_text())
    assert yaml_spec == json_spec
