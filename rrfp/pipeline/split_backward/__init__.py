"""The split backward for any module: B (the input gradient) and W (the weight gradient) as two
tasks over one autograd graph, and which of its nodes activation checkpointing recomputes."""
