"""Deprecated module: calibration is one package now, ``turboquant.calibration``. This name
re-exports it for one release and warns once."""
from .calibration import *  # noqa: F401,F403
from .calibration import __all__  # noqa: F401
from .checks import deprecated as _deprecated

_deprecated("the module turboquant.calibrate", "turboquant.calibration")
