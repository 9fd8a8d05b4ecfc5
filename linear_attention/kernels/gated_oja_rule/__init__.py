"""The gated Oja rule (FLA `ops/gated_oja_rule`): Oja's learning rule as a gated recurrence."""
