"""The catalogs a spec names: models, datasets, losses and GPU types."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from models.registry import ALLOWED_MODULES_ENV, DATASETS, DEFAULT_LOSS, LOSSES, MODELS
from tula_service.catalogs import gpu_catalog_listing
from tula_service.spec.job_spec import allowed_model_modules

router = APIRouter(prefix="/v1/catalog", tags=["catalog"])


@router.get("/models")
def catalog_models() -> dict[str, Any]:
    return {"models": [asdict(info) for info in sorted(MODELS.values(), key=lambda i: i.name)],
            "user_models": {"allowed_module_prefixes": allowed_model_modules(), "env": ALLOWED_MODULES_ENV}}

@router.get("/datasets")
def catalog_datasets() -> dict[str, Any]:
    return {"datasets": [asdict(info) for info in sorted(DATASETS.values(), key=lambda i: i.name)]}

@router.get("/losses")
def catalog_losses() -> dict[str, Any]:
    """The training losses a spec's `loss` names (models.losses), each with what its targets are; a user loss is an
    allowlisted "package.module:function", as user models are."""
    return {"losses": [asdict(info) for info in LOSSES.values()], "default": DEFAULT_LOSS,
            "user_losses": {"allowed_module_prefixes": allowed_model_modules(), "env": ALLOWED_MODULES_ENV}}

@router.get("/gpus")
def catalog_gpus() -> dict[str, Any]:
    """GPU types: memory, default price, intra-node link, peak BF16 and memory bandwidth (catalog-assumed)."""
    return {"gpus": gpu_catalog_listing()}
