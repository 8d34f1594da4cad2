"""The composition: config, its validation into a pipeline, the registry, the quick start."""
