"""Errors a user can fix: their message is one line naming what is wrong and what to do."""


class InputError(ValueError):
    """Bad input (arguments, config, corpus, model folder). The CLI prints it and exits with 2."""


class DamagedReference(InputError):
    """A stored baseline reference whose files do not hold what was written (bit rot, a partial copy): never
    used. An audit scores the baseline again; with ``rescore: never`` it stops on this."""


class NumericalError(RuntimeError):
    """A model produced NaN or infinite log-probabilities."""


class WorkerError(RuntimeError):
    """A worker that lacks what another has (a file every worker should see): a shard is tried elsewhere."""


class Abandoned(RuntimeError):
    """A run nobody waits for any more (the audit that submitted it stopped): it stops, and is not tried again."""


class TransientError(RuntimeError):
    """A failure worth retrying: network or remote storage. Prefect tasks retry on it, nothing else."""


def start_of(value: object, width: int = 40, count: bool = False) -> str:
    """A value as a line quotes it: its first ``width`` characters, where it may be thousands long (a name, a path, an
    argument); ``count``: the whole length said after it."""
    text = str(value)
    if len(text) <= width:
        return text
    return f"{text[:width]}…" + (f" ({len(text)} characters)" if count else "")


def one_line(error: BaseException) -> str:
    """An error's first line (its type's name when it has no message): what a user is shown."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def is_network_error(error: BaseException) -> bool:
    """Whether an error, or one it was raised from, is a connection or timeout failure."""
    seen = error
    while seen is not None:
        name = type(seen).__name__
        if isinstance(seen, (ConnectionError, TimeoutError)) or "Connect" in name or "Timeout" in name:
            return True
        seen = seen.__cause__ or seen.__context__
    return False
