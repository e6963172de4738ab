"""baseline: a float model as it is (the baseline's method, and a variant of the baseline's own weights)."""

from tasks.methods.method import Method

METHOD = Method("baseline", float_model=True, quantized_layers=False)
