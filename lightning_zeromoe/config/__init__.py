"""Options to a resolved, checked DeepSpeed config: sections, keywords, validation."""
