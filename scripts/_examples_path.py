"""Put the repository's ``examples/`` folder on ``sys.path``, once.

The training job (``gpt_training``) lives there, beside the installed library, and is not
installed by ``pip install``; the scripts that run it import this module first.
"""

from __future__ import annotations

import os
import sys

__all__ = ["EXAMPLES"]

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
