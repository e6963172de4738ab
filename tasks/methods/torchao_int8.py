"""torchao-int8: torchao's int8 weight-only quantization, the baseline quantized as it loads."""

from tasks.methods.method import Method

METHOD = Method("torchao-int8", quantized_at_load=True, package=("torchao", "torchao"))
