"""The model zoo: catalog data, real torch models on CPU at tiny sizes, and the workload entry point."""

import ast
import math

import pytest
import torch
from torch import nn

from models import registry
from models.gpt import GPT
from models.registry import (
    MODELS,
    TORCHVISION_CLASSIFIERS,
    compatible,
    image_size_problem,
    is_user_model_ref,
    user_model_allowed,
)
from models.vision import adapt_first_conv, torchvision_classifier
from models.workload import build_workload
from models.zoo import build_model

IMAGES = {"name": "synthetic_images", "num_samples": 64, "channels": 3, "image_size": 32, "num_classes": 10}
TOKENS = {"name": "synthetic_tokens", "num_samples": 64, "seq_len": 16, "vocab_size": 50}


def _parameters(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# --- the catalog as plain data ---------------------------------------------------------------------


def test_registry_imports_no_torch():
    tree = ast.parse(open(registry.__file__).read())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not any(name.startswith(("torch", "torchvision", "models.zoo", "models.data")) for name in imported)


def test_every_listed_torchvision_name_exists_in_torchvision():
    import torchvision

    available = set(torchvision.models.list_models(module=torchvision.models))
    assert set(TORCHVISION_CLASSIFIERS) <= available
    assert {"resnet50", "vgg16_bn", "mobilenet_v3_large", "efficientnet_b3", "vit_b_16", "convnext_tiny"} <= set(MODELS)


def test_compatible_matches_input_kinds_and_trusts_user_models():
    assert compatible("gpt", "synthetic_tokens") and compatible("resnet50", "digits") and compatible("cnn1d", "mnist1d")
    assert not compatible("gpt", "synthetic_images") and not compatible("mlp1d", "digits")
    assert compatible("acme.models:net", "token_file")


def test_user_model_refs_and_allowlist_match_whole_module_components():
    assert is_user_model_ref("acme.models:build") and is_user_model_ref("acme:build")
    assert not is_user_model_ref("resnet18") and not is_user_model_ref("acme.models:") and not is_user_model_ref("a b:c")
    assert user_model_allowed("acme.models:build", ["acme"])
    assert user_model_allowed("acme.models:build", ["other", "acme.models"])
    assert not user_model_allowed("acme_evil.models:build", ["acme"]) and not user_model_allowed("acme:build", [])


def test_image_size_rules_are_explained():
    assert image_size_problem("resnet18", 16) is None
    assert "image_size >= 32" in image_size_problem("vgg11", 16)
    assert "multiple of 16" in image_size_problem("vit_b_16", 40)
    with pytest.raises(ValueError, match="image_size >= 64"):
        build_model("alexnet", in_channels=3, image_size=32, num_classes=10)


# --- models ----------------------------------------------------------------------------------------

TORCHVISION_SAMPLES = [  # (name, in_channels, image_size): cheap on CPU, several families and stems
    ("resnet18", 1, 16),
    ("mobilenet_v3_small", 3, 32),
    ("squeezenet1_1", 2, 24),
    ("shufflenet_v2_x0_5", 3, 16),
    ("efficientnet_b0", 3, 16),
    ("googlenet", 3, 16),
    ("regnet_x_400mf", 4, 16),
    ("mnasnet0_5", 3, 16),
    ("swin_t", 3, 32),
    ("vit_b_32", 1, 32),
]


@pytest.mark.parametrize(("name", "in_channels", "image_size"), TORCHVISION_SAMPLES)
def test_torchvision_models_build_and_run_at_small_sizes(name, in_channels, image_size):
    model = build_model(name, in_channels=in_channels, image_size=image_size, num_classes=7)
    with torch.no_grad():
        logits = model(torch.randn(2, in_channels, image_size, image_size))
    assert logits.shape == (2, 7)


def test_adapting_the_first_conv_tiles_the_kernel_and_keeps_fan_in_scale():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
    original = model[0].weight.detach().clone()
    adapt_first_conv(model, 6)
    assert model[0].in_channels == 6
    assert torch.allclose(model[0].weight[:, :3], original * math.sqrt(3 / 6))
    assert torch.allclose(model[0].weight[:, 3:], original * math.sqrt(3 / 6))


def test_vit_is_built_for_the_requested_image_size():
    model = torchvision_classifier("vit_b_32", 3, 64, 10)
    assert model.image_size == 64 and model.encoder.pos_embedding.shape[1] == (64 // 32) ** 2 + 1


@pytest.mark.parametrize("name", ["small_cnn", "resnet18_cifar", "vgg11_cifar", "resnet_cifar"])
def test_cifar_models_train_on_32px_images(name):
    model = build_model(name, in_channels=3, image_size=32, num_classes=10)
    logits = model(torch.randn(2, 3, 32, 32))
    logits.sum().backward()
    assert logits.shape == (2, 10) and all(p.grad is not None for p in model.parameters())


def test_resnet18_cifar_keeps_32px_resolution_in_its_stem():
    model = build_model("resnet18_cifar", in_channels=3, image_size=32, num_classes=10)
    stem = model.maxpool(model.relu(model.bn1(model.conv1(torch.randn(1, 3, 32, 32)))))
    assert stem.shape[-2:] == (32, 32)


@pytest.mark.parametrize(("blocks", "parameters"), [(1, 77_754), (3, 272_186)])
def test_resnet_cifar_is_resnet_6n_plus_2_with_batch_norm_and_takes_small_images(blocks, parameters):
    model = build_model("resnet_cifar", options={"blocks": blocks}, in_channels=1, image_size=8, num_classes=10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convs) + 1 == 6 * blocks + 2  # 3x3 convs plus the head: He et al.'s depth (projections not counted)
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 6 * blocks + 1 + 2  # every conv, projections too
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    assert model(torch.randn(2, 1, 4, 4)).shape == (2, 10)  # the smallest side the catalog allows


@pytest.mark.parametrize(("name", "options"), [("linear1d", {}), ("mlp1d", {}), ("cnn1d", {}), ("cnn1d", {"channels": 8}), ("gru1d", {}),
                                              ("gru1d", {"hidden": 8, "layers": 2}), ("transformer1d", {}),
                                              ("transformer1d", {"patch": 3, "width": 16, "heads": 2, "layers": 1})])
def test_1d_models_take_batch_by_length_signals(name, options):
    model = build_model(name, options=options, length=40, num_classes=10)
    assert model(torch.randn(3, 40)).shape == (3, 10)


def test_linear1d_is_one_affine_map_and_refuses_options():
    model = build_model("linear1d", length=64, num_classes=10)
    assert [p.shape for p in model.parameters()] == [torch.Size([10, 64]), torch.Size([10])]
    signals = torch.randn(2, 64)
    assert torch.allclose(model(2 * signals) - model(signals), model(signals) - model(torch.zeros(2, 64)), atol=1e-5)  # linear
    with pytest.raises(ValueError, match="hidden"):
        build_model("linear1d", options={"hidden": 8}, length=64, num_classes=10)


def test_cnn1d_default_is_the_mnist1d_baseline_size():
    assert build_model("cnn1d", length=40, num_classes=10).head.in_features == 25 * 5


def test_gru1d_reads_the_signal_in_order_and_classifies_from_its_last_state():
    model = build_model("gru1d", options={"hidden": 8}, length=40, num_classes=10)
    assert model.gru.hidden_size == 8 and model.head.in_features == 8
    signals = torch.randn(2, 40)
    reversed_order = signals.flip(1)
    assert not torch.allclose(model(signals), model(reversed_order))  # a recurrence, not a bag of values
    assert model(torch.randn(2, 1)).shape == (2, 10)  # any length


def test_transformer1d_reads_patches_of_the_signal_as_positioned_tokens():
    model = build_model("transformer1d", options={"patch": 3, "width": 16, "heads": 2, "layers": 1}, length=40, num_classes=10).eval()
    assert model.tokens == 14 and model.embed.in_features == 3 and model.position.shape == (1, 14, 16)  # 40 padded to 42
    assert len(model.encoder.layers) == 1 and model.encoder.layers[0].norm_first
    signals = torch.randn(2, 40)
    swapped = torch.cat([signals[:, 3:6], signals[:, :3], signals[:, 6:]], dim=1)  # two patches exchanged
    assert not torch.allclose(model(signals), model(swapped), atol=1e-6)  # positions count: not a bag of patches
    with pytest.raises(ValueError, match="multiple of heads"):
        build_model("transformer1d", options={"width": 30, "heads": 4}, length=40, num_classes=10)


def test_gpt_gives_next_token_logits_with_a_tied_head():
    model = build_model("gpt", options={"layers": 1, "width": 32, "heads": 2}, vocab_size=50, seq_len=16)
    assert model(torch.randint(0, 50, (3, 16))).shape == (3, 16, 50)
    assert model.head.weight is model.token_embedding.weight
    assert len(model.blocks) == 1


def test_lstm_lm_gives_next_token_logits_that_read_only_the_past_and_trains_as_a_workload():
    model = build_model("lstm_lm", options={"width": 16, "layers": 2}, vocab_size=50, seq_len=12).eval()
    assert model.lstm.hidden_size == 16 and model.lstm.num_layers == 2 and model.head.out_features == 50
    tokens = torch.randint(0, 50, (2, 12))
    changed = tokens.clone()
    changed[:, 8] = (tokens[:, 8] + 1) % 50
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert before.shape == (2, 12, 50) and model(tokens[:, :5]).shape == (2, 5, 50)  # any length up to seq_len
    assert torch.allclose(before[:, :8], after[:, :8]) and not torch.allclose(before[:, 8:], after[:, 8:])
    with pytest.raises(ValueError, match="longer than the model's seq_len 12"):
        model(torch.randint(0, 50, (1, 13)))
    workload = build_workload({"model": "lstm_lm", "model_options": {"width": 16}, "dataset": TOKENS})
    inputs, targets = workload.data.batch(4, torch.Generator().manual_seed(0))
    workload.loss_fn(workload.model(inputs), targets).backward()
    assert all(p.grad is not None for p in workload.model.parameters())


def test_gpt_attention_is_causal():
    model = GPT(vocab_size=50, seq_len=12, layers=2, width=32, heads=4).eval()
    tokens = torch.randint(0, 50, (1, 12))
    changed = tokens.clone()
    changed[0, 8] = (tokens[0, 8] + 1) % 50
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.allclose(before[:, :8], after[:, :8], atol=1e-6)
    assert not torch.allclose(before[:, 8:], after[:, 8:])


@pytest.mark.parametrize(("name", "options", "shape", "inputs"), [
    ("mlp1d", {"hidden": 64, "dropout": 0.5}, {"length": 40, "num_classes": 10}, lambda: torch.randn(8, 40)),
    ("gpt", {"layers": 1, "width": 32, "heads": 2, "dropout": 0.3}, {"vocab_size": 50, "seq_len": 12}, lambda: torch.randint(0, 50, (4, 12))),
])
def test_dropout_is_random_in_training_and_off_in_eval_and_zero_leaves_the_model_as_it_was(name, options, shape, inputs):
    torch.manual_seed(0)
    model, batch = build_model(name, options=options, **shape).train(), inputs()
    assert not torch.allclose(model(batch), model(batch))  # a new mask per forward pass
    model.eval()
    assert torch.equal(model(batch), model(batch))
    torch.manual_seed(1)
    without = build_model(name, options={**options, "dropout": 0.0}, **shape).train()
    torch.manual_seed(1)
    plain = build_model(name, options={k: v for k, v in options.items() if k != "dropout"}, **shape).train()
    state = torch.get_rng_state()
    assert torch.equal(without(batch), plain(batch)) and torch.equal(torch.get_rng_state(), state)  # p = 0 draws nothing


def test_gpt_rejects_width_not_divisible_by_heads():
    with pytest.raises(ValueError, match="multiple of heads"):
        build_model("gpt", options={"width": 30, "heads": 4}, vocab_size=50, seq_len=8)


def test_unknown_model_and_unknown_option_are_explained():
    with pytest.raises(KeyError, match="model 'resnet5' is not in the catalog; did you mean resnet50.*; known: .*resnet18"):
        build_model("resnet5", in_channels=3, image_size=32, num_classes=10)
    with pytest.raises(ValueError, match=r"model_options \['depth'\] do not apply to model 'gpt' \(it takes: dropout, heads, layers"):
        build_model("gpt", options={"depth": 3}, vocab_size=50, seq_len=8)
    with pytest.raises(ValueError, match="must be of type int"):
        build_model("gpt", options={"layers": "two"}, vocab_size=50, seq_len=8)


def test_legacy_build_model_signature_still_works():
    model = build_model("small_cnn", in_channels=1, image_size=16, num_classes=4)
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 4)


# --- user models -----------------------------------------------------------------------------------

USER_MODEL = "tests.user_models_fixture:tiny_classifier"


def test_allowlisted_user_model_is_called_with_options_and_the_data_shape():
    request = {"model": USER_MODEL, "model_options": {"hidden": 5}, "dataset": IMAGES, "allowed_model_modules": ["tests"]}
    workload = build_workload(request)
    assert workload.model.built_with == {"in_channels": 3, "image_size": 32, "num_classes": 10, "hidden": 5}


def test_user_model_outside_the_allowlist_is_refused_with_the_fix():
    request = {"model": USER_MODEL, "dataset": IMAGES, "allowed_model_modules": ["acme"]}
    with pytest.raises(PermissionError, match="'tests.user_models_fixture'.*TULA_ALLOWED_MODEL_MODULES"):
        build_workload(request)


def test_user_factory_must_return_a_module():
    request = {"model": "tests.user_models_fixture:not_a_model", "dataset": IMAGES, "allowed_model_modules": ["tests"]}
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        build_workload(request)


# --- the workload entry point ----------------------------------------------------------------------


def test_same_seed_gives_same_weights_and_batches_and_leaves_the_global_rng_alone():
    request = {"model": "small_cnn", "dataset": IMAGES, "seed": 3}
    state = torch.random.get_rng_state()
    first, second = build_workload(request), build_workload(request)
    assert torch.equal(state, torch.random.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(_parameters(first.model), _parameters(second.model)))
    batch_a = first.data.batch(4, torch.Generator().manual_seed(1))
    batch_b = second.data.batch(4, torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(batch_a, batch_b))


def test_different_seeds_give_different_weights():
    first = build_workload({"model": "small_cnn", "dataset": IMAGES, "seed": 0})
    second = build_workload({"model": "small_cnn", "dataset": IMAGES, "seed": 1})
    assert not torch.equal(_parameters(first.model)[0], _parameters(second.model)[0])


def test_image_workload_loss_is_the_mean_over_samples():
    workload = build_workload({"model": "small_cnn", "dataset": IMAGES})
    images, labels = workload.data.batch(6, torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = workload.loss_fn(workload.model(images), labels)
        halves = [workload.loss_fn(workload.model(images[s]), labels[s]) for s in (slice(0, 3), slice(3, 6))]
    assert workload.input_kind == "image" and workload.tokens_per_sample is None
    assert whole.dim() == 0 and torch.allclose(whole, sum(halves) / 2, atol=1e-6)


def test_gpt_workload_counts_sequences_and_averages_over_tokens():
    request = {"model": "gpt", "model_options": {"layers": 1, "width": 32, "heads": 2}, "dataset": TOKENS}
    workload = build_workload(request)
    inputs, targets = workload.data.batch(4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = workload.model(inputs)
        loss = workload.loss_fn(logits, targets)
        per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1), reduction="none")
    assert workload.input_kind == "tokens" and workload.tokens_per_sample == 16
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.allclose(loss, per_token.mean())


def test_signal_workload_on_mnist1d():
    workload = build_workload({"model": "cnn1d", "dataset": {"name": "mnist1d", "num_samples": 200}})
    signals, labels = workload.data.batch(8, torch.Generator().manual_seed(0))
    loss = workload.loss_fn(workload.model(signals), labels)
    loss.backward()
    assert workload.input_kind == "signal1d" and signals.shape == (8, 40) and loss.item() > 0


def test_incompatible_model_and_dataset_are_refused():
    with pytest.raises(ValueError, match="model 'gpt' takes tokens inputs but dataset 'synthetic_images' gives image"):
        build_workload({"model": "gpt", "dataset": IMAGES})
