"""Stage 3, dispatch: which point runs next and on which worker (local processes or Ray), retries and kills,
the max-batch search and the re-timing of noisy points. See docs/architecture.md."""
