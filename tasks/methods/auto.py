"""auto: a checkpoint whose method is read from its files (tasks.models.formats.detect): the default with a path."""

from tasks.methods.method import Method

# kernel: a gptq or awq checkpoint is one of the two once read
METHOD = Method("auto", detected=True, needs_path=True, takes_kernel=True)
