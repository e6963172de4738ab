"""The versions of the libraries a number was computed with, recorded beside it."""

from __future__ import annotations

from importlib import metadata


def versions(*packages: str) -> dict[str, str]:
    found = {}
    for package in ("torch", "transformers", *packages):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return found
