"""Datasets: generated, bundled in a package, or read from a folder the test makes. Nothing is downloaded."""

import socket

import numpy as np
import pytest
import torch
from PIL import Image

from models.data import build_dataset
from models.registry import DATASETS, MNIST1D_MAX_SAMPLES


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a dataset tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_legacy_build_dataset_signature_still_works():
    data = build_dataset("synthetic_images", channels=1, image_size=16, num_classes=4, seed=0)
    images, labels = data.batch(5, _gen())
    assert images.shape == (5, 1, 16, 16) and labels.max() < 4


def test_defaults_come_from_the_catalog():
    data = build_dataset("synthetic_tokens")
    assert data.shape == {"vocab_size": 256, "seq_len": 64}


def test_unknown_and_missing_fields_are_explained():
    with pytest.raises(ValueError, match=r"fields \['channels'\] do not apply to dataset 'digits' \(it takes: image_size, scaling, split\)"):
        build_dataset("digits", channels=3)
    with pytest.raises(ValueError, match="dataset 'token_file' needs the field"):
        build_dataset("token_file")
    with pytest.raises(KeyError, match="dataset 'cifar10' is not in the catalog"):
        build_dataset("cifar10")


def test_synthetic_tokens_targets_are_inputs_shifted_by_one():
    inputs, targets = build_dataset("synthetic_tokens", vocab_size=30, seq_len=10).batch(4, _gen())
    assert inputs.shape == targets.shape == (4, 10) and inputs.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_synthetic_tokens_are_deterministic_given_seed_and_generator():
    first = build_dataset("synthetic_tokens", vocab_size=30, seq_len=10, seed=1).batch(4, _gen(7))
    second = build_dataset("synthetic_tokens", vocab_size=30, seq_len=10, seed=1).batch(4, _gen(7))
    other_chain = build_dataset("synthetic_tokens", vocab_size=30, seq_len=10, seed=2).batch(4, _gen(7))
    assert torch.equal(first[0], second[0]) and not torch.equal(first[1], other_chain[1])


def test_synthetic_tokens_have_learnable_bigram_structure():
    vocab = 64
    inputs, targets = build_dataset("synthetic_tokens", vocab_size=vocab, seq_len=32).batch(256, _gen())
    counts = torch.zeros(vocab, vocab)
    counts.index_put_((inputs.flatten(), targets.flatten()), torch.ones(inputs.numel()), accumulate=True)
    successors_seen = (counts > 0).sum(dim=1)
    assert successors_seen.max() <= 8  # each token has at most 8 possible successors, out of 64


def test_digits_default_is_the_train_split_scaled_as_shipped(no_network):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = build_dataset("digits")
    assert len(data.labels) == DATASETS["digits"].fixed_num_samples == 1437
    shipped = load_digits()
    train_x, _, train_y, _ = train_test_split(shipped.data / 16.0, shipped.target, test_size=0.2, random_state=0)
    assert torch.allclose(data.images.flatten(1), torch.from_numpy(train_x).float())
    assert data.labels.tolist() == train_y.tolist()
    assert float(data.images.min()) == 0.0 and float(data.images.max()) == 1.0
    images, labels = data.batch(16, _gen())
    assert images.shape == (16, 1, 8, 8) and set(labels.tolist()) <= set(range(10))


def test_digits_standard_scaling_uses_the_split_statistics():
    data = build_dataset("digits", scaling="standard")
    assert abs(float(data.images.mean())) < 1e-5 and abs(float(data.images.std()) - 1) < 1e-5
    raw = build_dataset("digits", scaling="raw")
    assert torch.allclose(raw.images / 16, build_dataset("digits").images) and float(raw.images.max()) == 16.0


def test_digits_all_split_is_the_1797_images_in_scikit_learn_order():
    from sklearn.datasets import load_digits

    data = build_dataset("digits", split="all", scaling="raw")
    assert len(data.labels) == DATASETS["digits"].split_sizes["all"] == 1797
    assert torch.equal(data.images.squeeze(1), torch.from_numpy(load_digits().images).float())
    with pytest.raises(ValueError, match="digits split 'test' is not one of train, all"):
        build_dataset("digits", split="test")


def test_digits_resize_to_the_requested_size():
    images, _ = build_dataset("digits", image_size=20).batch(3, _gen())
    assert images.shape == (3, 1, 20, 20)


def test_mnist1d_is_generated_offline_rounded_to_ten_per_class(no_network):
    data = build_dataset("mnist1d", num_samples=95)
    signals, labels = data.batch(12, _gen())
    assert signals.shape == (12, 40) and signals.dtype == torch.float32 and set(labels.tolist()) <= set(range(10))
    assert len(data.labels) == 100  # rounded up to 10 per class
    assert torch.bincount(data.labels, minlength=10).tolist() == [10] * 10


def test_mnist1d_generates_more_than_the_reference_5000():
    assert len(build_dataset("mnist1d", num_samples=5_010).labels) == 5_010


def test_mnist1d_refuses_more_than_its_stated_bound():
    assert DATASETS["mnist1d"].max_num_samples == MNIST1D_MAX_SAMPLES == 200_000
    with pytest.raises(ValueError, match="mnist1d generates at most 200000 samples \\(asked for 200001\\)"):
        build_dataset("mnist1d", num_samples=200_001)


def test_mnist1d_generation_restores_the_global_numpy_state():
    np.random.seed(5)
    expected = np.random.rand()
    np.random.seed(5)
    build_dataset("mnist1d", num_samples=30)
    assert np.random.rand() == expected


def _image_folder(root, sizes_px=((12, 9), (20, 20), (7, 15))):
    for label, color in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (root / label).mkdir(parents=True)
        for index, size in enumerate(sizes_px):
            Image.new("RGB", size, color).save(root / label / f"{index}.png")
    return root


def test_image_folder_reads_classes_from_subfolders(tmp_path):
    data = build_dataset("image_folder", path=str(_image_folder(tmp_path / "pets")), image_size=16)
    images, labels = data.batch(8, _gen())
    assert data.num_classes == 2 and data.shape["in_channels"] == 3
    assert images.shape == (8, 3, 16, 16) and 0 <= float(images.min()) and float(images.max()) <= 1
    red = images[labels == 0]
    assert torch.allclose(red[:, 0], torch.ones_like(red[:, 0])) and float(red[:, 2].max()) == 0


def test_image_folder_can_read_grayscale(tmp_path):
    data = build_dataset("image_folder", path=str(_image_folder(tmp_path / "pets")), image_size=8, channels=1)
    assert data.batch(2, _gen())[0].shape == (2, 1, 8, 8)


def test_image_folder_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="'/nowhere/images' does not exist"):
        build_dataset("image_folder", path="/nowhere/images")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="one sub-folder of images per class"):
        build_dataset("image_folder", path=str(tmp_path / "empty"))


def test_token_bin_file_windows_come_from_the_file(tmp_path):
    tokens = (np.arange(1000) * 7 % 3000).astype(np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    data = build_dataset("token_file", path=str(path), seq_len=12)
    inputs, targets = data.batch(5, _gen())
    assert data.vocab_size == int(tokens.max()) + 1 and inputs.shape == (5, 12)
    for row_in, row_target in zip(inputs, targets):
        start = int(np.flatnonzero(tokens == int(row_in[0]))[0])
        assert row_in.tolist() == tokens[start : start + 12].tolist()
        assert row_target.tolist() == tokens[start + 1 : start + 13].tolist()


def test_token_bin_file_rejects_ids_beyond_the_given_vocab(tmp_path):
    path = tmp_path / "train.bin"
    np.full(100, 500, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match="token id 500 >= vocab_size 300"):
        build_dataset("token_file", path=str(path), seq_len=8, vocab_size=300).batch(2, _gen())


def test_other_token_files_are_raw_bytes(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("hello tula " * 20)
    inputs, _ = build_dataset("token_file", path=str(path), seq_len=6).batch(3, _gen())
    assert inputs.max() < 256
    assert all(bytes(row.tolist()).decode() in "hello tula " * 20 for row in inputs)
    with pytest.raises(ValueError, match="has 220 tokens; seq_len 300 needs at least 301"):
        build_dataset("token_file", path=str(path), seq_len=300)
