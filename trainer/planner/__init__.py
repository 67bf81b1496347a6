"""The layout planner: search over meshes and schedules, the cost model, measurements, calibration, reports."""
