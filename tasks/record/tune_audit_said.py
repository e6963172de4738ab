"""The audit of a tune's recipe as the tune reads it, typed: the audit's config and the names it gives its models
(``RecipeAudit``: ``tasks.audit.recipe.proof.audit_of``'s plain data), and each model as scored there
(``AuditedModel``: its per-token KL against the baseline). Read once, here, where ``flows.tune`` gets them. Light:
no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from tasks.record.results import VariantResult


@dataclass(frozen=True)
class RecipeAudit:
    """The audit of the recipe: its config as written to ``audit.yaml`` (plain data) and its name, and the names of
    its models: the recipe's (``tuned``), the uniform variant's, the uniform variant of equal or larger size's
    (``larger``; None without one)."""

    config: dict
    name: str
    tuned: str
    uniform: str
    larger: str | None

    @classmethod
    def of(cls, config: dict, names: dict[str, str]) -> RecipeAudit:
        return cls(config, config["name"], names["tuned"], names["uniform"], names.get("larger"))


@dataclass(frozen=True)
class AuditedModel:
    """A model of the audit of the recipe as scored on one domain (``scored``), and its per-token KL against the
    baseline (``kl``; None where it failed, or was scored without divergence)."""

    scored: VariantResult
    kl: np.ndarray | None

    @classmethod
    def of(cls, scored: VariantResult) -> AuditedModel:
        return cls(scored, scored.result.extra.kl if scored.ok else None)
