"""Compression of deltas and outer gradients: one codec interface, several codecs, and
error feedback for the lossy ones (as hivemind's compression package).

`from p2pdiloco import compress` then `compress.make_codec(...)`: this face hands on the
names of `codecs`.
"""

from p2pdiloco.compress.codecs import *  # noqa: F401,F403
from p2pdiloco.compress.codecs import __all__  # noqa: F401
