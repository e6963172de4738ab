"""Errors a user can fix: their message is one line naming what is wrong and what to do."""


class InputError(ValueError):
    """Bad input (arguments, config, corpus, model folder). The CLI prints it and exits with 2."""


class NumericalError(RuntimeError):
    """A model produced NaN or infinite log-probabilities."""
