"""An audit resolved once: ``open_audit`` turns a config into the ``AuditPlan`` that every command and flow runs.

It is the only place a config becomes a plan. The CLI makes the plan before Prefect starts (bad input ends there,
exit 2) and hands it to the flow, which only runs it; a run Prefect starts from plain parameters (a deployment, a
served or scheduled run) makes it on entry, from the same function. Making it loads no model: the config is read
and checked, every model is found once (``tasks.audit.checkpoints.prepare``), the corpus is read and tokenized once
(cached on disk), and what the stream decides is checked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, InstanceOf, model_serializer

from tasks.audit.checkpoints import Lineup, llama_perplexity_stream, prepare
from tasks.audit.events import event_config
from tasks.audit.preflight import check_calibration_room, check_audit_settings, check_stream, preflight
from tasks.audit.reference import baseline_key
from tasks.audit.scoring import baseline_identity
from tasks.audit.served import Policy, Refused
from tasks.config import AuditConfig, Corpus, load_audit_config
from tasks.core.errors import InputError
from tasks.data.corpus import corpus_text
from tasks.data.evaluation import Evaluation, check_encodable, evaluation
from tasks.models.llama_cpp import stream_difference
from tasks.record.result import Naming


@dataclass(frozen=True)
class Domain:
    """One corpus of an audit, resolved: the corpus the config gives (``corpus``: its name, and how lines and
    refusals name it: by that name, or not at all for an audit's one corpus), the one-corpus audit it is scored and
    judged as (``config``: ``AuditConfig.for_domain``) and its token stream and settings (``evaluation``)."""

    corpus: Corpus
    config: AuditConfig
    evaluation: Evaluation

    @property
    def name(self) -> str:
        return self.corpus.name


class Event(BaseModel):
    """What a ``quantization.completed`` event asks to audit: the checkpoint at ``model_path`` (its ``method``,
    ``bits`` (informative) and ``name`` when the event gives them) against ``baseline`` (else the config's). A
    field the event lacks arrives as "" (``flows.serve``'s trigger): not given."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str = ""
    method: str = ""
    bits: int | str = ""
    baseline: str = ""
    name: str = ""

    def described(self) -> dict:
        """What the event says of its checkpoint besides where it is."""
        return {k: v for k, v in self.model_dump().items() if k != "model_path" and v not in ("", None)}


class AuditPlan(BaseModel):
    """One audit, resolved: what every step reads, and nothing is resolved again after it is made.

    Attributes:
        config: the validated config, overrides applied (a triggered audit's: narrowed to its checkpoint).
        path: the YAML it was read from.
        lineup: the baseline and its variants, each found once, with its gate.
        domains: each corpus's token stream, text and settings, in the config's order (one for ``corpus:``).
        said: a triggered audit's line on what it audits and why; "" otherwise.
    """

    # every part is a value already validated where it was made, held as it is (checked by type only): a config
    # narrowed by a command (a reference's: no variants) is not what a whole audit's must be
    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    config: InstanceOf[AuditConfig]
    path: str
    lineup: InstanceOf[Lineup]
    domains: tuple[InstanceOf[Domain], ...]
    said: str = ""

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def evaluation(self) -> Evaluation:
        """The first domain's evaluation: a one-corpus audit's, and what variants made here are calibrated on."""
        return self.domains[0].evaluation

    @property
    def by_domain(self) -> bool:
        """Whether the audit names its domains (``corpora:``), each judged and shown on its own."""
        return self.config.corpora is not None

    @property
    def naming(self) -> Naming:
        return Naming(self.by_domain)

    def domain(self, name: str) -> Domain:
        """The domain called ``name``; an ``InputError`` naming the audit's when it has none of that name."""
        found = next((d for d in self.domains if d.name == name), None)
        if found is None:
            raise InputError(f"--corpus {name}: the audit {self.name} has no corpus of that name; its corpora are "
                             f"{', '.join(d.name for d in self.domains)}")
        return found

    def alone(self, name: str) -> AuditPlan:
        """The plan of the one-corpus audit of the domain ``name`` (its ``config`` and stream alone): what a command
        that works on one stream reads (a diagnosis, a baseline's key). Its variants made here are still calibrated
        on the first domain's corpus, as in the audit of all of them."""
        domain = self.domain(name)
        return self.model_copy(update={"config": domain.config, "domains": (domain,)})

    @model_serializer
    def _shown(self) -> dict:
        """What Prefect stores and shows of a plan handed to a flow (its UI's parameters): which audit, not its
        tokens (the plan holds the whole corpus text and token stream)."""
        settings = self.evaluation.settings
        return {"audit": self.name, "config": self.path, "baseline": self.lineup.baseline.source,
                "variants": [c.name for c in self.lineup.variants],
                "tokens": self.naming.whole({d.name: len(d.evaluation.stream.ids) for d in self.domains}, dict),
                "window": settings.window, "stride": settings.stride}


def open_audit(path: str, overrides: list[str] | tuple[str, ...] = (), event: Event | None = None,
               narrow: Callable[[AuditConfig], AuditConfig] | None = None, strict: bool = True) -> AuditPlan:
    """The audit of the config at ``path``, resolved into its plan; every refusal is raised here (``InputError``,
    ``Refused`` under a serve's policy) before any model is loaded.

    Args:
        overrides: ``key=value`` settings that replace the file's.
        event: audit the one checkpoint an event names (``tasks.audit.events``) instead of the config's variants.
        narrow: what of the config a command audits (a diagnosis: one variant; a reference: the baseline alone).
        strict: refuse a variant that cannot be scored now (the CLI); a run Prefect starts lets it fail alone.
    """
    served = Policy.current()
    if served:
        served.check_run(path, list(overrides))
    config = load_audit_config(path, list(overrides))
    said = ""
    if event is not None and (event.model_path or event.described()):
        config, said = _for_event(config, event, served)
    if narrow is not None:
        config = narrow(config)
    registry = check_audit_settings(config)
    lineup = llama_perplexity_stream(prepare(config.baseline, config.variants, registry, config.thresholds),
                                     config.evaluation.mode)
    preflight(config, lineup, strict)
    domains = read_domains(config, lineup.tokenizer, lineup.transformers_tokenizer)
    check_calibration_room(config, lineup, domains[0].evaluation)
    for domain in domains:
        _within(domain.corpus, lambda d=domain: check_stream(d.config, lineup, d.evaluation))
    return AuditPlan(config=config, path=path, lineup=lineup, domains=domains, said=said)


def audit_settings(path: str) -> AuditConfig:
    """The config at ``path`` read and checked, not resolved (no model found, no corpus read): what a command that
    reads only what an audit recorded needs (``ppl-audit card``: its name and tracking)."""
    return load_audit_config(path)


def read_domains(config: AuditConfig, tokenizer, compared_with=None) -> tuple[Domain, ...]:
    """Each corpus of ``config`` read and tokenized once (cached on disk) as its one-corpus audit would, and checked:
    the baseline's tokenizer can encode it. Every domain's variants made here are calibrated on the first's.
    ``compared_with``: where ``tokenizer`` is llama.cpp's, transformers' tokenizer of the baseline, whose stream of
    each domain is compared with it (``Evaluation.tokens_differ``)."""
    domains = []
    for corpus in config.domains:
        alone = config.for_domain(corpus)
        scored = _within(corpus, lambda a=alone: evaluation(corpus_text(a.corpus), tokenizer, a.evaluation,
                                                            progress=True))
        if compared_with is not None:
            theirs = evaluation(scored.text, compared_with, alone.evaluation)
            scored = replace(scored, tokens_differ=stream_difference(theirs.stream.ids.tolist(),
                                                                     scored.stream.ids.tolist()),
                             tokenized_by=tokenizer.named)
        # named as the key holding the text: _within's "corpora.NAME: " before "corpus: " read as two keys
        check_encodable(scored.stream, tokenizer, corpus.key)
        domains.append(Domain(corpus, alone, scored if not domains else scored.calibrating(domains[0].evaluation)))
    return tuple(domains)


def _within(corpus: Corpus, check: Callable):
    """``check()``, its refusal naming the domain ``corpus`` in an audit of several (``corpora.NAME: ...``; an
    audit of one corpus names none)."""
    try:
        return check()
    except InputError as error:
        raise type(error)(f"{corpus.within}{error}") from None


def baseline_alone(config: AuditConfig) -> AuditConfig:
    """An audit's config without its variants: what a reference is built from, and what names its audits."""
    return config.model_copy(update={"variants": []})


def baseline_key_of(plan: AuditPlan) -> str:
    """The key of the plan's baseline as its audits record it (``tasks.audit.reference.baseline_key``): from its
    files, tokenizer and the token stream, no model loaded."""
    _, identity, _ = baseline_identity(plan.lineup.baseline, plan.evaluation)
    if identity is None:
        raise InputError(f"baseline: {plan.config.baseline.path} is not on this machine, so nothing names its audits; "
                         "give --baseline KEY instead (the ppl_audit.baseline_key tag of its audits' runs)")
    return baseline_key(identity)


def _for_event(config: AuditConfig, event: Event, served: Policy | None) -> tuple[AuditConfig, str]:
    """The config narrowed to the checkpoint ``event`` names, and the line saying under which name it is audited."""
    if not event.model_path:  # they describe an event's checkpoint: the config's audit would ignore them
        raise (Refused if served else InputError)(
            f"{', '.join(f'{k} {v}' for k, v in event.described().items())} given without model_path: they describe "
            "the checkpoint an event names; give its model_path too, or leave them out to run the config's own audit")
    if served:
        served.check_event(config, event.model_path, event.baseline or None)
    narrowed, why = event_config(config, event.model_path, event.method or None, event.baseline or None,
                                 event.name or None)
    return narrowed, f"auditing {event.model_path} as {narrowed.variants[0].name}: {why}"
