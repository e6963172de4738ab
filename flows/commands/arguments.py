"""What the commands' arguments share: their types, and defaults and choices read from the config."""

from __future__ import annotations

import argparse
import re
from typing import Literal, get_args, get_origin

# an MLflow run id as MLflow makes them (uuid4().hex): MLflow 3.17's server takes any 1 to 256 word characters, but a
# run it made has this form, and checking it first keeps a mistyped or pasted argument from reaching the store
RUN_ID = re.compile(r"[0-9a-f]{32}")
VERBOSE = "show library output (warnings, gptqmodel, Prefect) live on stderr; it is always in the log file"


def batch_size_argument(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a whole number or auto") from None


def config_field(model, name: str):
    """A config field's default and, for a ``Literal`` (or an optional one), its choices: the CLI's
    defaults and choice lists are the config's, written once."""
    info = model.model_fields[name]
    kinds = [info.annotation] if get_origin(info.annotation) is Literal else \
        [a for a in get_args(info.annotation) if a is not type(None)]
    if kinds and all(get_origin(kind) is Literal for kind in kinds):
        return info.default, [choice for kind in kinds for choice in get_args(kind)]
    return info.default, None


def tcp_port(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1 to 65535)")
    return int(value)


def age(value: str) -> float:
    units = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    if len(value) < 2 or value[-1] not in units or not value[:-1].replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(f"'{value}' is not an age; use a number and m, h, d or w, e.g. 30d")
    return float(value[:-1]) * units[value[-1]]


def size(value: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    number, unit = (value[:-1], value[-1].upper()) if value[-1:].upper() in units else (value, "")
    if not number.replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(f"'{value}' is not a size; use a number and K, M, G or T, e.g. 20G")
    return int(float(number) * units.get(unit, 1))


def is_run_id(value: str) -> bool:
    return RUN_ID.fullmatch(value) is not None


def quoted(value: str) -> str:
    """An argument as a line quotes it (``start_of``), in quotes, and how long it is where it was cut."""
    from tasks.core.errors import start_of

    return f"'{start_of(value)}'" + (f" ({len(value)} characters)" if len(value) > 40 else "")


def check_run_id(value: str, what: str) -> str:
    """``value``, an argument (``what``) that names an MLflow run, checked for the form of one before any store is
    asked; else one line."""
    from tasks.core.errors import InputError

    if not is_run_id(value):
        raise InputError(f"{what}: {quoted(value)} is not an MLflow run id (32 hex digits, as the run's page in the "
                         "MLflow UI shows it)")
    return value
