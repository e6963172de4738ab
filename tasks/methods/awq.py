"""awq: made here from the baseline with gptqmodel (bits, group_size, sym, calibration), or an AWQ checkpoint."""

from tasks.methods import gptqmodel
from tasks.methods.method import Method

METHOD = Method(
    "awq", quantized_here=True, settings=gptqmodel.GptqmodelSettings, gptqmodel_kernels=True, package=gptqmodel.PACKAGE,
    # what gptqmodel 7.6.0's torch kernel (AwqTorchLinear) takes: the kernel that runs on every device
    kernel_group_sizes=(-1, 16, 32, 64, 128),
    tune_refusal=" (gptqmodel 7.6.0's AWQ quantizes every module at one bit width and group size: its dynamic only "
                 "skips modules)")
