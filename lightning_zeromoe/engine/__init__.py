"""Around the DeepSpeed engine: param groups, processes, collectives, ZeRO-3 pitfalls."""
