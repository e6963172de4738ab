"""What a served audit may be asked to do through the Prefect API, which has no authentication by default.

``ppl-audit serve CONFIG`` serves that config alone: a flow run created through the API (by an event, the
UI, or anyone who reaches the API) is held to it. It may not name another config or override any setting
(``tracking.uri`` would send the record elsewhere; ``runner.address`` would make the serving host a client of
another scheduler, unpickling what it sends); the model folders it names must lie in the allowed roots (the
config's own paths, the cache's quantized checkpoints, and ``serve --allow DIR``); an event's ``baseline``
counts only where the config says ``schedule.event_baseline: true``. The serving process hands the policy to
its flow runs' processes in the environment (``PPL_AUDIT_SERVED``), which the API cannot set for a served
deployment's runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tasks.config import AuditConfig
from tasks.core.errors import InputError
from tasks.core.places import cache_dir

VARIABLE = "PPL_AUDIT_SERVED"


class Refused(InputError):
    """A served run asked for what its config does not allow."""


@dataclass(frozen=True)
class Policy:
    """The served config, the folders its runs may read and write, and whether an event may set the baseline."""

    config: str
    roots: tuple[str, ...]
    event_baseline: bool

    @classmethod
    def of(cls, config_path: str, config: AuditConfig, allow: list[str]) -> Policy:
        """The policy of serving ``config`` (read from ``config_path``), with ``allow`` added to its roots."""
        paths = [spec.path for spec in (config.baseline, *config.variants) if spec.path and spec.path != "embedded"]
        paths += [corpus.source for corpus in config.domains] + [str(cache_dir() / "quantized")]
        roots = [str(Path(path).expanduser().resolve()) for path in [*paths, *allow] if _local(path)]
        return cls(str(Path(config_path).resolve()), tuple(dict.fromkeys(roots)), config.schedule.event_baseline)

    def environment(self) -> dict[str, str]:
        return {VARIABLE: json.dumps([self.config, self.roots, self.event_baseline])}

    @classmethod
    def current(cls) -> Policy | None:
        """The policy of the process's ``serve``; None outside one (``run``, tests calling flows)."""
        said = os.environ.get(VARIABLE)
        if not said:
            return None
        config, roots, event_baseline = json.loads(said)
        return cls(config, tuple(roots), event_baseline)

    def check_run(self, config: str, overrides: list[str] | None) -> None:
        if str(Path(config).resolve()) != self.config:
            raise Refused(f"this serve runs {self.config} only, not {config}")
        if overrides:
            raise Refused(f"a served audit takes no overrides ({', '.join(overrides)}); change "
                             f"{self.config} and serve it again")

    def check_path(self, what: str, path: str) -> None:
        """Refuse ``path`` (a model folder or file, a corpus, an output folder) outside the allowed roots."""
        if not _local(path):
            raise Refused(f"{what} {path} is not a local path in this serve's allowed folders")
        resolved = Path(path).expanduser().resolve()
        if not any(resolved == Path(root) or resolved.is_relative_to(root) for root in self.roots):
            raise Refused(f"{what} {path} is outside this serve's allowed folders; allow it with "
                             "`ppl-audit serve --allow DIR`")

    def check_event(self, config: AuditConfig, model_path: str, baseline: str | None) -> None:
        """An event's checkpoint within the roots, and its baseline only where the config lets events set it."""
        self.check_path("model_path", model_path)
        if baseline and not _same(baseline, config.baseline.path):
            if not self.event_baseline:
                raise Refused(f"the event names baseline {baseline}, but this config's baseline is "
                                 f"{config.baseline.path} (set schedule.event_baseline: true to let events choose)")
            self.check_path("baseline", baseline)


def _local(path: str) -> bool:
    """A path on this machine, not a Hub id, registry name or remote URL."""
    return "://" not in path and path != "embedded" and (path.startswith(("/", ".", "~")) or Path(path).exists())


def _same(path: str, other: str | None) -> bool:
    return other is not None and (path == other or (_local(path) and _local(other) and
                                                    Path(path).expanduser().resolve() == Path(other).expanduser().resolve()))
