"""membound's CUDA layers over caller-owned CUDA arrays (nanobind; built where nvcc is found). Use
membound.ops and membound.nn: the same functions as _layers, on spec.device and spec.stream."""

from ._layers import Spec as Spec
from ._layers import backward as backward
from ._layers import decode_reset as decode_reset
from ._layers import decode_sizes as decode_sizes
from ._layers import decode_step as decode_step
from ._layers import forward as forward
from ._layers import parameters as parameters
from ._layers import sizes as sizes
from ._layers import ttt_mini_batches as ttt_mini_batches
