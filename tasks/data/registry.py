"""Variants from the MLflow Model Registry: ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS``.

The version's files are downloaded once (cached by name and version) and scored like any folder; after
the audit the version gets tags with the verdict and the audit's run ids, and a passing version gets
the alias ``ppl-audit-passed``.
"""

from __future__ import annotations

from tasks.core.errors import InputError

PASSED_ALIAS = "ppl-audit-passed"


def is_registered(path: str | None) -> bool:
    return bool(path) and path.startswith("models:/")


def model_version(uri: str, client) -> tuple[str, str]:
    """(name, version) of a ``models:/`` URI, resolving an alias."""
    rest = uri.removeprefix("models:/")
    if "@" in rest:
        name, alias = rest.split("@", 1)
        return name, client.get_model_version_by_alias(name, alias).version
    name, _, version = rest.partition("/")
    if not version.isdigit():
        raise InputError(f"{uri}: give models:/NAME/VERSION or models:/NAME@ALIAS")
    return name, version


def download(uri: str, tracking: str) -> str:
    """A local folder holding the registered version's model (the shallowest folder with config.json).

    Args:
        tracking: the tracking server whose model registry holds it.
    """
    import mlflow
    from mlflow import MlflowClient

    from tasks.core.places import cache_dir

    try:
        client = MlflowClient(tracking_uri=tracking, registry_uri=tracking)
        name, version = model_version(uri, client)
        target = cache_dir() / "registry" / name / version
        if not any(target.rglob("config.json")):
            target.mkdir(parents=True, exist_ok=True)
            # the version's own files: MLflow 3.17 resolves a models:/ URI against the process-wide registry,
            # whatever registry_uri it is given
            mlflow.artifacts.download_artifacts(artifact_uri=client.get_model_version_download_uri(name, version),
                                                dst_path=str(target), tracking_uri=tracking)
    except mlflow.exceptions.MlflowException as error:
        raise InputError(f"cannot fetch {uri} from the model registry: {str(error).splitlines()[0]}") from None
    configs = sorted(target.rglob("config.json"), key=lambda p: len(p.parts))
    if not configs:
        raise InputError(f"{uri} holds no transformers model (no config.json in its files)")
    return str(configs[0].parent)


def tag_version(client, uri: str, verdict: str, reason: str, run_id: str, parent_run_id: str) -> None:
    """Write the audit's verdict onto the registered version; a passing one gets the alias."""
    name, version = model_version(uri, client)
    tags = {"ppl_audit.verdict": verdict, "ppl_audit.reason": reason[:5000], "ppl_audit.run_id": run_id,
            "ppl_audit.audit_run_id": parent_run_id}
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    if verdict == "pass":
        client.set_registered_model_alias(name, PASSED_ALIAS, version)

