"""The rows of the fault matrix for one job's identity and one checkpoint folder's owner: two
torchrun agents as one job started alike but for one ``--set`` on node 1, and two jobs on one
folder. tests/app/job/test_fault_matrix_agents.py runs them; the table in docs/faults.md prints
them."""

from __future__ import annotations

API = "rrfp train, 2 torchrun agents"
FINISHES, REFUSED = "finishes", "refused, one line naming the key and both nodes"
# case: (what node 1 sets differently, the key the line names; None: nothing differs)
CASES = {
    "same job": ((), None),
    "model": (("run.model=llama",), "run.model"),
    "seed": (("run.seed=5",), "run.seed"),
    "lr": (("optim.lr=0.002",), "optim.lr"),
    "n_microbatches": (("n_microbatches=6",), "schedule.n_microbatches"),
    "checkpoint dir": (("checkpoint.dir={tmp}/other",), "checkpoint.dir"),
}
ROWS = [(API, case, FINISHES if key is None else REFUSED) for case, (_, key) in CASES.items()]
OWNER_API = "rrfp train, 2 jobs on one checkpoint.dir"
OWNER_ROWS = [
    (OWNER_API, "second job", "refused, one line naming the owner"),
    (OWNER_API, "owner killed", "a new job resumes"),
    (OWNER_API, "two started at once", "one owns it, the other refused; no step mixed"),
]
