"""What the tests share and no test file defines: the processes they start and the environment
those inherit (launch, distributed, rank_procs, cli_run, forked_python), the
single-process references they compare against, and where the repository is."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
