"""The job and point states, in a module of their own so that the client and the CLI can read them
without loading the storage layer (SQLAlchemy): tula_service.store.db stores them, the API publishes them.

A job or point is active until it reaches a terminal state. A job takes its points while queued or
profiling, then fits them; a point whose worker died goes from running back to queued.
"""

ACTIVE_JOB_STATES = ("queued", "profiling", "fitting")
PROFILING_JOB_STATES = ("queued", "profiling")  # its queued points may be claimed
TERMINAL_JOB_STATES = ("done", "failed", "cancelled")
JOB_STATES = ACTIVE_JOB_STATES + TERMINAL_JOB_STATES
ACTIVE_POINT_STATES = ("queued", "running")
TERMINAL_POINT_STATES = ("done", "oom", "failed", "cancelled")
POINT_STATES = ACTIVE_POINT_STATES + TERMINAL_POINT_STATES
