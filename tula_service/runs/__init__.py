"""Live runs: telemetry from a training run that follows a job's recommendation, and re-planning from it."""
