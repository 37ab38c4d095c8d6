"""`rrfp bench`'s parts: the suite (suite), one interface over every contender on a rank (runners),
torch.distributed.pipelining's schedules as its anchors (torch_schedules, used by nothing else), the
rank's job (rank), its launch from the parent (launch) through torchrun's agent with the ranks'
imports done once (agent), the figures (analysis) and the results
folder (report). The command itself is rrfp/app/cli/bench_command.py."""
