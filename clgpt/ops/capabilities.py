"""The capabilities record moved to the device layer (clgpt/device/capabilities.py), where the device is made:
this name stays while tests import it from here. The record picks among the forms of kernels/matmul.cl and the
other kernel files.
"""

from clgpt.device.capabilities import GEMM_BACKENDS, Capabilities, capabilities

__all__ = ["GEMM_BACKENDS", "Capabilities", "capabilities"]
