"""The names a scoring run's settings take: the plan's mode and the BOS policy.

Plain Python, imported by the stream (``tasks.engine.stream``), the planner (``tasks.engine.windows``) and the
validated config alike, so that none of them imports another for a type.
"""

from __future__ import annotations

from typing import Literal, get_args

Mode = Literal["sliding", "gptq", "llama.cpp"]  # ours, the GPTQ/AWQ papers', llama-perplexity's
MODES = get_args(Mode)
BosPolicy = Literal["none", "stream", "window"]  # no BOS, one before the stream, one before every window
BOS_POLICIES = get_args(BosPolicy)
