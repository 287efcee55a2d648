"""Compression of deltas and outer gradients, shaped as hivemind's compression package.

`base` holds the codec interface, `casts`, `blockwise`, `topk`, `sparse` and `zstd` the
codecs, `feedback` error feedback for the lossy ones, `registry` the codecs by name, and
`tensors` the encoding and bounded decoding of named tensors. `from p2pdiloco import
compress` then `compress.make_codec(...)`: this face hands on their public names.
"""

from p2pdiloco.compress.base import Codec as Codec
from p2pdiloco.compress.base import EncodedTensor as EncodedTensor
from p2pdiloco.compress.feedback import ErrorFeedback as ErrorFeedback
from p2pdiloco.compress.registry import CODECS as CODECS
from p2pdiloco.compress.registry import check_layout as check_layout
from p2pdiloco.compress.registry import codec_for as codec_for
from p2pdiloco.compress.registry import make_codec as make_codec
from p2pdiloco.compress.registry import make_codec_from_config as make_codec_from_config
from p2pdiloco.compress.tensors import MAX_DECODE_ELEMENTS as MAX_DECODE_ELEMENTS
from p2pdiloco.compress.tensors import LazyTensors as LazyTensors
from p2pdiloco.compress.tensors import decode_tensor as decode_tensor
from p2pdiloco.compress.tensors import decode_tensors as decode_tensors
from p2pdiloco.compress.tensors import encode_tensors as encode_tensors
from p2pdiloco.compress.tensors import lazy_tensors as lazy_tensors
from p2pdiloco.compress.zstd import MAX_ZSTD_RATIO as MAX_ZSTD_RATIO
