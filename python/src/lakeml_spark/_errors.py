"""The error lakeml_spark raises when the workers fail a partition (no dependencies: the
local workers' supervisor imports it too)."""


class WorkerError(RuntimeError):
    """Every endpoint tried for a partition failed (or the worker refused the request)."""
