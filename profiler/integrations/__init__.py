"""Callbacks that connect a training framework's loop to a Tula run (profiler.tula_run.TulaRun): gradient
statistics out, the run's advice in. Each is an optional extra: `profiler.integrations.lightning` needs
`tula[lightning]`, `profiler.integrations.huggingface` needs `tula[huggingface]` (docs/integrations.md)."""
