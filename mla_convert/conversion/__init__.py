"""The conversion of a source model into a native MLA checkpoint, one file a stage: options, plan, the calibration text
(calibration, selftext), the statistics, the per-layer method (the closed form), layer refinement (refine_layer), the
model stage, the time estimates, the resume store and the driver (`pipeline.convert`)."""
