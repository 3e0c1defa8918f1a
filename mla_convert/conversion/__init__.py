"""The conversion of a source model into a native MLA checkpoint, in phases: options, plan, the per-layer method,
the refinement stages, the resume store and the driver (`pipeline.convert`)."""
