"""Stage 1, spec: what a valid job is (JobSpec), its bounds, the published submission schema, spec files and
the check of a user's own model and data code. See docs/architecture.md."""
