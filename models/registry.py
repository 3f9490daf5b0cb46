"""The workload catalog as plain data: names, descriptions, options, dataset fields and defaults.

This module never imports torch, so the server can validate job specs against the catalog
without the worker extras installed. The torch side lives in `models.zoo` (models), `models.data`
(datasets) and `models.workload` (the one entry point the profiler calls).

Input kinds (what a dataset gives and a model consumes):
- "image":    float tensors (batch, channels, image_size, image_size), integer class labels (batch,)
- "signal1d": float tensors (batch, length), integer class labels (batch,)
- "tokens":   integer token ids (batch, seq_len), next-token targets (batch, seq_len)

Losses (a job spec's `loss`, LOSSES): cross-entropy by default (next-token cross-entropy on tokens); "mse", "l1"
and "bce_with_logits" take float targets of the model output's shape (batch, num_classes), num_classes then being
the model's number of outputs; or an allowlisted "package.module:function" loss of the user's own.

User code ("package.module:factory" models, datasets and losses, allowlisted by TULA_ALLOWED_MODEL_MODULES)
follows the contract of `models.user_contract` (docs/user_models.md).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

ALLOWED_MODULES_ENV = "TULA_ALLOWED_MODEL_MODULES"

# What a dataset of each input kind reports in `shape`, i.e. the keyword arguments a model factory receives.
SHAPE_KEYS: dict[str, tuple[str, ...]] = {
    "image": ("in_channels", "image_size", "num_classes"),
    "signal1d": ("length", "num_classes"),
    "tokens": ("vocab_size", "seq_len"),
}

# The dataset fields a job spec may give besides name and num_samples (`tula_service.spec.job_spec.DatasetSpec`).
# A catalog dataset takes the ones in its DatasetInfo.fields; a user dataset factory receives those given.
DATASET_SPEC_FIELDS = ("channels", "image_size", "num_classes", "seq_len", "vocab_size", "path", "scaling", "split")


@dataclass(frozen=True)
class ModelInfo:
    name: str
    description: str
    input_kind: str
    options: dict[str, object] = field(default_factory=dict)  # allowed model_options -> default
    min_image_size: int = 1  # smallest square input side (pixels) the architecture can take
    image_size_multiple: int = 1  # e.g. a ViT's patch size: the side must be a multiple of it


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    description: str
    input_kind: str
    fields: dict[str, object] = field(default_factory=dict)  # spec fields besides name/num_samples -> default (None: none)
    required: tuple[str, ...] = ()
    fixed_num_samples: int | None = None  # the data set's own size, when it has one (then num_samples may be omitted)
    split_sizes: dict[str, int] = field(default_factory=dict)  # its size per `split` value (fixed_num_samples: the default's)
    max_num_samples: int | None = None  # the most samples a generated data set makes
    targets: str = "labels"  # "labels" (int64 classes or next tokens: cross-entropy) or "float" (regression: mse by default)
    default_loss: str = "cross_entropy"  # the loss a spec without `loss` trains with on it


# Classification models built from torchvision by name (random init, `weights=None`). Each name is in
# `torchvision.models.list_models(module=torchvision.models)` (a worker test checks it). Left out:
# maxvit_t, whose window partition only fits inputs of 224 x 224 and multiples.
TORCHVISION_CLASSIFIERS: tuple[str, ...] = (
    "alexnet",
    "convnext_tiny", "convnext_small", "convnext_base", "convnext_large",
    "densenet121", "densenet161", "densenet169", "densenet201",
    "efficientnet_b0", "efficientnet_b1", "efficientnet_b2", "efficientnet_b3",
    "efficientnet_b4", "efficientnet_b5", "efficientnet_b6", "efficientnet_b7",
    "efficientnet_v2_s", "efficientnet_v2_m", "efficientnet_v2_l",
    "googlenet", "inception_v3",
    "mnasnet0_5", "mnasnet0_75", "mnasnet1_0", "mnasnet1_3",
    "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large",
    "regnet_x_400mf", "regnet_x_800mf", "regnet_x_1_6gf", "regnet_x_3_2gf", "regnet_x_8gf",
    "regnet_x_16gf", "regnet_x_32gf",
    "regnet_y_400mf", "regnet_y_800mf", "regnet_y_1_6gf", "regnet_y_3_2gf", "regnet_y_8gf",
    "regnet_y_16gf", "regnet_y_32gf", "regnet_y_128gf",
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d",
    "wide_resnet50_2", "wide_resnet101_2",
    "shufflenet_v2_x0_5", "shufflenet_v2_x1_0", "shufflenet_v2_x1_5", "shufflenet_v2_x2_0",
    "squeezenet1_0", "squeezenet1_1",
    "swin_t", "swin_s", "swin_b", "swin_v2_t", "swin_v2_s", "swin_v2_b",
    "vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn", "vgg19", "vgg19_bn",
    "vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14",
)  # fmt: skip

# Smallest input side that runs forward, probed on CPU at sides 8, 16, 24, 32, 48, 64, 75 (the first
# that worked); families not listed take 8 (the probe's floor). Strided stems and floor-pooling make
# every larger side work too.
_TORCHVISION_MIN_SIDE = {
    "alexnet": 64, "vgg": 32, "densenet": 32, "convnext": 32, "squeezenet": 24, "googlenet": 16, "inception_v3": 75,
}  # fmt: skip


def _torchvision_min_side(name: str) -> int:
    return next((side for family, side in _TORCHVISION_MIN_SIDE.items() if name.startswith(family)), 8)


def vit_patch_size(name: str) -> int | None:
    """Patch side of a torchvision ViT name ("vit_b_16" -> 16), None for other models."""
    match = re.fullmatch(r"vit_[a-z]_(\d+)", name)
    return int(match.group(1)) if match else None


def _torchvision_info(name: str) -> ModelInfo:
    patch = vit_patch_size(name)
    size_rule = f"image_size a multiple of {patch}" if patch else f"image_size >= {_torchvision_min_side(name)}"
    return ModelInfo(
        name,
        f"torchvision {name}, random init (no weights downloaded); first conv adapted to the channels; {size_rule}.",
        "image",
        min_image_size=patch or _torchvision_min_side(name),
        image_size_multiple=patch or 1,
    )


_OWN_MODELS = (
    ModelInfo(
        "small_cnn",
        "Two conv blocks and a linear head for small (e.g. 32x32) images; ~0.3M parameters.",
        "image",
        min_image_size=4,
    ),
    ModelInfo(
        "resnet18_cifar",
        "ResNet-18 for 32x32 images: 3x3 stride-1 stem, no max-pool (He et al. 2016, CIFAR setup); 11M parameters.",
        "image",
        min_image_size=4,
    ),
    ModelInfo(
        "resnet_cifar",
        "The CIFAR ResNet of He et al. 2016 (sec. 4.2) with batch norm: 16-32-64 channels, `blocks` basic blocks per"
        " stage (1: ResNet-8, 78k parameters; 3: ResNet-20, 0.27M); any side >= 4 (global average pool).",
        "image",
        options={"blocks": 1},
        min_image_size=4,
    ),
    ModelInfo(
        "vgg11_cifar",
        "VGG-11 with batch norm for 32x32 images: conv stack, global average pool, one linear layer; 9M parameters.",
        "image",
        min_image_size=32,
    ),
    ModelInfo(
        "linear1d",
        "Multinomial logistic regression for 1D signals: length -> classes, one linear layer (a convex loss).",
        "signal1d",
    ),
    ModelInfo(
        "mlp1d",
        "MLP for 1D signals (MNIST-1D baseline): length -> hidden -> hidden -> classes, ReLU; `dropout` after each hidden"
        " ReLU (Srivastava et al. 2014; 0: none).",
        "signal1d",
        options={"hidden": 100, "dropout": 0.0},
    ),
    ModelInfo(
        "cnn1d",
        "1D CNN for signals (MNIST-1D baseline): three strided Conv1d layers and a linear head.",
        "signal1d",
        options={"channels": 25},
    ),
    ModelInfo(
        "gru1d",
        "GRU for 1D signals (MNIST-1D baseline): one value per time step, the last hidden state -> classes.",
        "signal1d",
        options={"hidden": 32, "layers": 1},
    ),
    ModelInfo(
        "transformer1d",
        "Transformer encoder for 1D signals: the signal in patches of `patch` values as tokens, `layers` pre-LayerNorm"
        " encoder layers of `width` with `heads` heads, mean-pooled -> classes (a vision transformer in 1D).",
        "signal1d",
        options={"patch": 4, "width": 32, "heads": 4, "layers": 2},
    ),
    ModelInfo(
        "lstm_lm",
        "LSTM language model: token embedding, `layers` LSTM layers of `width` units, linear head over the vocabulary;"
        " seq_len and vocab_size come from the dataset; batch counted in sequences.",
        "tokens",
        options={"width": 64, "layers": 1},
    ),
    ModelInfo(
        "gpt",
        "GPT-style decoder-only transformer LM (pre-LayerNorm, causal self-attention, tied head);"
        " seq_len and vocab_size come from the dataset; batch counted in sequences; `dropout` on the embeddings, the"
        " attention weights and each residual branch, as GPT-2 (0: none).",
        "tokens",
        options={"layers": 2, "width": 128, "heads": 4, "dropout": 0.0},
    ),
)

MODELS: dict[str, ModelInfo] = {
    info.name: info for info in (*_OWN_MODELS, *(_torchvision_info(name) for name in TORCHVISION_CLASSIFIERS))
}

DIGITS_SPLIT_SIZES = {"train": 1437, "all": 1797}  # 1797 - ceil(0.2 * 1797): models.datasets_bundled.Digits
DIABETES_SPLIT_SIZES = {"train": 353, "all": 442}  # 442 - ceil(0.2 * 442): models.datasets_bundled.Diabetes
MNIST1D_MAX_SAMPLES = 200_000  # generating takes ~0.3 ms per sample on one idle core (50 000 in ~17 s), in every profiling point

DATASETS: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        DatasetInfo(
            "synthetic_images",
            "Gaussian images with labels from a fixed random teacher (learnable, generated, no download).",
            "image",
            fields={"channels": 3, "image_size": 32, "num_classes": 10},
        ),
        DatasetInfo(
            "synthetic_tokens",
            "Token sequences from a fixed random sparse Markov chain (learnable, generated, no download);"
            " input = tokens[:-1], target = tokens[1:].",
            "tokens",
            fields={"vocab_size": 256, "seq_len": 64},
        ),
        DatasetInfo(
            "digits",
            "scikit-learn's bundled handwritten digits (1797 grayscale 8x8 images, 10 classes; real data, no download)"
            " as a training run sees them: split 'train' (default) = the train part of scikit-learn's"
            " train_test_split(test_size=0.2, random_state=0), 1437 images; 'all' = the 1797; scaling 'unit'"
            " (default: X/16, pixels in [0, 1]), 'standard' (mean/std of the split's pixels) or 'raw' (0..16);"
            " resized to image_size.",
            "image",
            fields={"image_size": 8, "scaling": "unit", "split": "train"},
            fixed_num_samples=DIGITS_SPLIT_SIZES["train"],
            split_sizes=DIGITS_SPLIT_SIZES,
        ),
        DatasetInfo(
            "diabetes",
            "scikit-learn's bundled diabetes regression data (Efron et al. 2004: 442 patients, 10 measurements, a disease"
            " progression score a year on; real data, no download) as a regression run sees it: split 'train' (default) ="
            " the train part of train_test_split(test_size=0.2, random_state=0), 353 patients; 'all' = the 442; the"
            " measurements and the score standardized (mean 0, std 1 over the split, as StandardScaler does);"
            " 10-value signals with one float target each (num_classes = 1 output), trained with mse by default.",
            "signal1d",
            fields={"split": "train"},
            fixed_num_samples=DIABETES_SPLIT_SIZES["train"],
            split_sizes=DIABETES_SPLIT_SIZES,
            targets="float",
            default_loss="mse",
        ),
        DatasetInfo(
            "mnist1d",
            "MNIST-1D (Greydanus 2020): length-40 signals of 10 classes, generated offline by the mnist1d package:"
            f" num_samples of them (rounded up to a multiple of 10), at most {MNIST1D_MAX_SAMPLES}"
            " (~0.3 ms each, again in every profiling point).",
            "signal1d",
            max_num_samples=MNIST1D_MAX_SAMPLES,
        ),
        DatasetInfo(
            "image_folder",
            "Images on the worker in ImageFolder layout (path/<class>/<image>); one class per folder;"
            " loaded with PIL and resized to image_size.",
            "image",
            fields={"path": None, "image_size": 32, "channels": 3},
            required=("path",),
        ),
        DatasetInfo(
            "token_file",
            "Token ids in a file on the worker: a .bin file holds uint16 ids (nanoGPT layout; vocab_size given"
            " or max id + 1), any other file is raw bytes (vocab 256); random windows of seq_len + 1 tokens.",
            "tokens",
            fields={"path": None, "seq_len": 64, "vocab_size": None},
            required=("path",),
        ),
    )
}


@dataclass(frozen=True)
class LossInfo:
    name: str
    description: str
    targets: str  # what a dataset's targets must be: "labels" (int64 class indices), "float" or "probabilities" (in [0, 1]),
    # the last two of the model output's shape
    formula: str


DEFAULT_LOSS = "cross_entropy"

# The training losses a job spec may name (`loss`); models.losses holds their torch side. Each is a mean over the
# batch's samples, as the two-batch noise estimator needs (the mean over a split batch is the mean of its halves'
# means): a sum would scale |g_B| with B.
LOSSES: dict[str, LossInfo] = {
    info.name: info
    for info in (
        LossInfo("cross_entropy", "Classification (the default); on token data next-token cross-entropy over every position.",
                 "labels", "(1/B) sum_i -log softmax(z_i)[y_i]  (tokens: mean over the B x T positions)"),
        LossInfo("mse", "Regression: mean squared error over every output.", "float", "(1/(B k)) sum_i |z_i - y_i|^2"),
        LossInfo("l1", "Regression: mean absolute error over every output.", "float", "(1/(B k)) sum_i |z_i - y_i|_1"),
        LossInfo("bce_with_logits", "Multi-label classification: binary cross-entropy of each output's logit, targets in [0, 1].",
                 "probabilities", "(1/(B k)) sum_ij -[y_ij log s(z_ij) + (1 - y_ij) log(1 - s(z_ij))], s the logistic sigmoid"),
    )
}


def resolved_loss(loss: str | None, dataset_name: str) -> str | None:
    """The loss a job trains with: the spec's, else its catalog dataset's default (mse on float targets), else None
    (cross-entropy, models.losses)."""
    if loss is not None or dataset_name not in DATASETS:
        return loss
    default = DATASETS[dataset_name].default_loss
    return None if default == DEFAULT_LOSS else default


def loss_problem(loss: str | None, dataset_name: str) -> str | None:
    """Why a spec's loss cannot train on its catalog dataset, or None: a loss of float targets on class labels or
    tokens, or one of labels on float targets (a user loss or a user dataset: their contract check decides). Unknown
    names are the spec's own error."""
    if loss is None or is_user_ref(loss) or loss not in LOSSES or dataset_name not in DATASETS:
        return None
    info, takes = DATASETS[dataset_name], LOSSES[loss].targets
    if takes == info.targets:
        return None
    if info.targets == "float":
        floats = ", ".join(name for name, entry in LOSSES.items() if entry.targets == "float")
        what = "class labels" if takes == "labels" else "targets in [0, 1] (multi-label)"
        return (f"loss '{loss}' takes {what}; catalog dataset '{dataset_name}' gives float targets (a regression): use {floats} "
                f"(or leave loss out: {info.default_loss})")
    gives = "token ids" if info.input_kind == "tokens" else "class labels"
    return (f"loss '{loss}' takes float targets of the model output's shape; catalog dataset '{dataset_name}' gives {gives}: "
            f"use {DEFAULT_LOSS} (or leave loss out), or a user dataset (package.module:factory) with float targets")


def unknown_name_message(kind: str, name: str, known: dict[str, object]) -> str:
    """The error a user can act on: what was asked for, the nearest names, and what exists."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"{kind} '{name}' is not in the catalog{hint}; known: {', '.join(sorted(known))}"


_USER_CODE_REF = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def is_user_ref(name: str) -> bool:
    """True for a "package.module:factory" reference to a model or dataset outside the catalog."""
    return _USER_CODE_REF.fullmatch(name) is not None


is_user_model_ref = is_user_ref  # the name model code has always used


def not_allowlisted_message(kind: str, ref: str) -> str:
    """Why a user `kind` ("model" or "dataset") reference is refused, and the operator's fix."""
    module = ref.split(":", 1)[0]
    return (
        f"user {kind} module '{module}' is not allowlisted (importing it runs its code); the server "
        f"operator can allow it with {ALLOWED_MODULES_ENV}={module} (comma-separated module prefixes)"
    )


def user_model_allowed(ref: str, allowed_prefixes: list[str]) -> bool:
    """Whether the module of `ref` is under one of the allowlisted module prefixes.

    A prefix matches whole dotted components: "acme" allows "acme" and "acme.models", not "acme_evil".
    """
    module = ref.split(":", 1)[0]
    for prefix in (p.strip().rstrip(".") for p in allowed_prefixes):
        if prefix and (module == prefix or module.startswith(prefix + ".")):
            return True
    return False


def compatible(model_name: str, dataset_name: str) -> bool:
    """A catalog model fits a catalog dataset when both have the same input kind; user models and user
    datasets always may try (their input kind is known once built: the submit-time contract check)."""
    if is_user_ref(dataset_name):
        return True
    if dataset_name not in DATASETS:
        raise KeyError(unknown_name_message("dataset", dataset_name, DATASETS))
    if is_user_ref(model_name):
        return True
    if model_name not in MODELS:
        raise KeyError(unknown_name_message("model", model_name, MODELS))
    return MODELS[model_name].input_kind == DATASETS[dataset_name].input_kind


def image_size_problem(model_name: str, image_size: int) -> str | None:
    """Why a catalog image model cannot take `image_size` x `image_size` inputs, or None when it can."""
    info = MODELS.get(model_name)
    if info is None or info.input_kind != "image":
        return None
    if image_size % info.image_size_multiple:
        return f"model '{model_name}' needs image_size to be a multiple of {info.image_size_multiple} (got {image_size})"
    if image_size < info.min_image_size:
        return f"model '{model_name}' needs image_size >= {info.min_image_size} (got {image_size})"
    return None


MAX_MODEL_OPTION_INT = 1_000_000  # a layer count, width or channel count beyond this is a typo, not a model
PROBABILITY_OPTIONS = ("dropout",)  # the catalog's float options: each a probability in [0, 1)


def resolved_model_options(model_name: str, given: dict[str, object] | None) -> dict[str, object]:
    """A catalog model's options with defaults filled in, checked against their types and bounds.

    A catalog option is a size (layers, width, heads, hidden units, channels): an integer in
    [1, MAX_MODEL_OPTION_INT], a whole float (from YAML, say) taken as its integer; or a probability
    (PROBABILITY_OPTIONS: dropout) in [0, 1), an integer 0 taken as 0.0. The GPT's width must split
    evenly into its heads. Raises ValueError naming the option; checked at submit, so a wrong type is
    a 422 rather than a failed point on the worker.
    """
    defaults = MODELS[model_name].options
    given = dict(given or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        accepted = ", ".join(sorted(defaults)) or "none"
        raise ValueError(f"model_options {unknown} do not apply to model '{model_name}' (it takes: {accepted})")
    for option, value in given.items():
        expected = type(defaults[option])
        if expected is int and isinstance(value, float) and value.is_integer():
            value = given[option] = int(value)
        if expected is float and type(value) is int:
            value = given[option] = float(value)
        if type(value) is not expected:
            raise ValueError(f"model option '{option}' of '{model_name}' must be of type {expected.__name__} (got {value!r})")
        if expected is int and not 1 <= value <= MAX_MODEL_OPTION_INT:
            raise ValueError(f"model option '{option}' of '{model_name}' must be between 1 and {MAX_MODEL_OPTION_INT} (got {value})")
        if expected is float and not 0.0 <= value < 1.0:
            raise ValueError(f"model option '{option}' of '{model_name}' is a probability: at least 0 and below 1 (got {value})")
    options = {**defaults, **given}
    if {"width", "heads"} <= options.keys() and options["width"] % options["heads"]:
        raise ValueError(f"model '{model_name}': width ({options['width']}) must be a multiple of heads ({options['heads']})")
    return options
