"""The target side: chat ingestion and rendering, the target loader and its layer taps (prefill),
and the generate engines."""
