"""bnb-int8: bitsandbytes' 8-bit weights, the baseline quantized as it loads (or a saved checkpoint)."""

from tasks.methods.method import Method

METHOD = Method("bnb-int8", quantized_at_load=True, package=("bitsandbytes", "bitsandbytes"))
