"""Stage 2, store: jobs, points and tokens in SQLite or PostgreSQL, each state change in one transaction, and
the migrations. states.py imports no SQLAlchemy, so that the client can read the states. See
docs/architecture.md."""
