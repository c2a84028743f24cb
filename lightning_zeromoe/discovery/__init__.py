"""Where the MoE blocks are: structure, Hugging Face semantics, expert lists, patterns."""
