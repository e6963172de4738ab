"""fp8: a checkpoint in transformers' fine-grained FP8 format, loaded from its path on a GPU."""

from tasks.methods.method import Method

METHOD = Method("fp8", needs_path=True,
                # transformers' FP8 quantizer checks for a GPU itself
                gpu_only="fp8 checkpoints (transformers' fine-grained FP8) need a GPU; on CPU audit a "
                         "compressed-tensors FP8 checkpoint, whose activation quantization is emulated")
