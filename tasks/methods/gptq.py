"""gptq: made here from the baseline with gptqmodel (bits, group_size, sym, calibration; dynamic: per module), or a
GPTQ checkpoint loaded from its path; the method ppl-audit tune sets module by module."""

from tasks.methods import gptqmodel
from tasks.methods.method import Method, Tune

METHOD = Method(
    "gptq", quantized_here=True, settings=gptqmodel.SETTINGS, gptqmodel_kernels=True, takes_kernel=True,
    takes_dynamic=True, package=gptqmodel.PACKAGE, also_versions=("optimum",),
    # what gptqmodel 7.6.0's torch kernel (TorchLinear) takes: the kernel that runs on every device
    kernel_group_sizes=(-1, 16, 32, 64, 128, 256, 512, 1024),
    tune=Tune(recipe="dynamic", gptqmodel=True))
