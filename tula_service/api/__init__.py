"""The HTTP API (see tula_service.api.app): `create_app(Settings(...))` makes the FastAPI app."""

from tula_service.api.app import EXECUTORS, Settings, create_app, default_database_url
from tula_service.api.openapi import standard_bounds
from tula_service.settings import DATABASE_URL_ENV

__all__ = ["DATABASE_URL_ENV", "EXECUTORS", "Settings", "create_app", "default_database_url", "standard_bounds"]
