"""What each quantization method and runtime is, one module each, reached through ``tasks.methods.registry``.

Pure Python, no torch at import: the config validates a variant against its method's descriptor, below the
models that load it. What needs torch (a load config, quantizing, a loaded model's facts) stays in tasks.models,
looked up there by the method's name.
"""
