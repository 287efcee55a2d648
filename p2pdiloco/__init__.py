"""p2pdiloco: peer-to-peer Decoupled DiLoCo training over ordinary internet links."""

from p2pdiloco.errors import (
    ConfigError,
    DataError,
    DeviceError,
    NetworkSetupError,
    P2PDilocoError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DataError",
    "DeviceError",
    "NetworkSetupError",
    "P2PDilocoError",
    "__version__",
]
