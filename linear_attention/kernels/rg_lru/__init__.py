"""Griffin's RG-LRU (RecurrentGemma's recurrence): a gated diagonal linear recurrence."""
