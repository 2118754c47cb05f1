"""What a CPU's measurements decide: the pass-cost model, per-step tree sizing, pacing, the choice of drafter."""
