"""Chat data: reading chat rows from JSONL/Parquet (OpenAI ``messages``, ShareGPT ``conversations``,
reasoning fields) and rendering them with the target's chat template into token ids and loss masks."""
