"""compressed-tensors: a checkpoint in the compressed-tensors format (llm-compressor's), loaded from its path."""

from tasks.methods.method import Method

METHOD = Method("compressed-tensors", needs_path=True, package=("compressed_tensors", "compressed-tensors==0.20.0"),
                in_formats_extra=True)
