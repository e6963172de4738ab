"""bnb-nf4: bitsandbytes' 4-bit NF4 weights, the baseline quantized as it loads (or a saved checkpoint, on a GPU)."""

from tasks.methods.method import Method

METHOD = Method("bnb-nf4", quantized_at_load=True, package=("bitsandbytes", "bitsandbytes"),
                saved_on_cpu="a saved NF4 checkpoint reloads corrupted on CPU; drop path to quantize the baseline at load")
