"""What crosses the network: frames (`frames`), the swarm's messages and records on them
(`messages`), outer updates (`updates`), signed contributions (`contributions`) and a
fragment's state in parts (`state_transfer`). Pure: no sockets, no event loops.

`from p2pdiloco import wire` then `wire.decode_message(...)`: this face hands on the names
of `frames`.
"""

from p2pdiloco.wire.frames import *  # noqa: F401,F403
from p2pdiloco.wire.frames import __all__  # noqa: F401
