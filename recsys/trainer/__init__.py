"""The trainer, by job: `build` (what a rank trains with), `loop` (the per-rank job and its
steps), `outputs` (what a run leaves on disk)."""
