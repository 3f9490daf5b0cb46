"""Stage 5, plan: the sweep over batch x devices x accumulation, pricing, the objectives and the knee, the
advice (LR, warm-up, AGS), the recommendation contract and re-planning (what-if). See docs/architecture.md."""
