"""Fixes: apply a float32 fallback to a live model (``fallback``), turn findings into recommendations
(``recommend``, pure) and prove them by re-running the step (``verify``)."""
