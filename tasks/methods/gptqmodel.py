"""What gptq and awq share: gptqmodel makes them here from the baseline and its kernels run them."""

# what gptq and awq are quantized with when made here
SETTINGS = ("bits", "group_size", "sym", "calibration")
PACKAGE = ("gptqmodel", "gptqmodel==7.6.0")
