"""The frozen target model: its loader (local files only), the layer taps of its prefill (the cache's
features), and the engines that let it write answers in the generate stage (transformers, vLLM)."""
