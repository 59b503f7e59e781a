"""A program run's trace beyond the run itself: the `arbor trace` command, OpenTelemetry
spans and the SVG timeline."""
