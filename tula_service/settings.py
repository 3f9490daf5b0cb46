"""Every environment variable Tula reads, in one pydantic-settings object (`environment()`).

| variable | field | read by |
|---|---|---|
| TULA_DATABASE_URL | database_url | `tula serve` and the server's other commands (default sqlite:///var/tula.db) |
| TULA_URL, TULA_TOKEN | url, token | the client and the CLI's client commands |
| TULA_ALLOWED_HOSTS | allowed_hosts | `tula serve`: Host names beyond the bound address and loopback (comma-separated) |
| TULA_ALLOWED_MODEL_MODULES | allowed_model_modules | the spec: module prefixes of user `module:factory` code (comma-separated) |
| TULA_DATA_ROOTS | data_roots | the spec and the profiling requests: folders file datasets may be read from (os.pathsep-separated) |
| TULA_MAX_BATCH_SIZES, TULA_MAX_DEVICES | max_batch_sizes, max_devices | the spec's bounds (tula_service.spec.spec_limits) |

The environment is read at each call, not once at import: `tula serve --data-root` sets TULA_DATA_ROOTS
for the server and the workers it starts, and tests change it. A malformed value (a limit that is not a
positive integer) is the operator's error, raised at once with the variable's name.
"""

from __future__ import annotations

import os
from typing import Annotated

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from models.data_roots import DATA_ROOTS_ENV
from models.registry import ALLOWED_MODULES_ENV

ENV_PREFIX = "TULA_"
DEFAULT_DATABASE_URL = "sqlite:///var/tula.db"
DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_MAX_BATCH_SIZES = 64
DEFAULT_MAX_DEVICES = 65_536

# Each variable's name, for messages that tell an operator what to set. The two the workers' code names
# in its own messages are defined there (models/ never imports tula_service).
DATABASE_URL_ENV = "TULA_DATABASE_URL"
URL_ENV = "TULA_URL"
TOKEN_ENV = "TULA_TOKEN"
ALLOWED_HOSTS_ENV = "TULA_ALLOWED_HOSTS"
MAX_BATCH_SIZES_ENV = "TULA_MAX_BATCH_SIZES"
MAX_DEVICES_ENV = "TULA_MAX_DEVICES"
assert ALLOWED_MODULES_ENV == ENV_PREFIX + "ALLOWED_MODEL_MODULES" and DATA_ROOTS_ENV == ENV_PREFIX + "DATA_ROOTS"

CommaList = Annotated[list[str], NoDecode]


def _split(raw: object, separator: str) -> object:
    if isinstance(raw, str):
        return [part.strip() for part in raw.split(separator) if part.strip()]
    return raw


class Environment(BaseSettings):
    """The TULA_* variables, parsed; unset ones take their defaults."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    database_url: str = Field(DEFAULT_DATABASE_URL, min_length=1)
    url: str = Field(DEFAULT_URL, min_length=1)
    token: str | None = None
    allowed_hosts: CommaList = Field(default_factory=list)
    allowed_model_modules: CommaList = Field(default_factory=list)
    data_roots: CommaList = Field(default_factory=list)
    max_batch_sizes: int = Field(DEFAULT_MAX_BATCH_SIZES, ge=1)
    max_devices: int = Field(DEFAULT_MAX_DEVICES, ge=1)

    @field_validator("allowed_hosts", "allowed_model_modules", mode="before")
    @classmethod
    def _comma_separated(cls, raw: object) -> object:
        return _split(raw, ",")

    @field_validator("data_roots", mode="before")
    @classmethod
    def _path_separated(cls, raw: object) -> object:
        return _split(raw, os.pathsep)

    @model_validator(mode="before")
    @classmethod
    def _blank_is_unset(cls, values: object) -> object:
        """A variable set but blank means its default, as an unset one does."""
        if isinstance(values, dict):
            return {k: v for k, v in values.items() if not (isinstance(v, str) and not v.strip())}
        return values


def environment() -> Environment:
    """The environment as it is now. Raises RuntimeError naming the variable for a malformed value."""
    try:
        return Environment()
    except ValidationError as error:
        first = error.errors()[0]
        name = ENV_PREFIX + str(first["loc"][0]).upper()
        raise RuntimeError(f"{name}={os.environ.get(name, '')!r}: {first['msg']}") from None
