"""Where Slurm 22.05 puts the tasks and which GPUs each task sees (measured on the local test cluster:
tests/test_placement_slurm.py). Owns: the placement rules. Imports: kit.bounded, kit.findings, kit.slurm, kit.site.
"""
from __future__ import annotations

import re

from kit.bounded import whole_number
from kit.findings import Findings
from kit.site import JEAN_ZAY, node_cap, node_type
from kit.slurm import Job, implicit_ntasks


# -- the placement: where Slurm puts the tasks and which GPUs each sees (measured on the test cluster) --

def gpu_view(job: Job, local_rank: int, tasks_on_node: int, gpus_on_node: int,
             findings: Findings) -> list[str]:
    """The GPU ids one task sees, as Slurm shows them (seen on the test cluster): all of the node's without
    binding; its own share with --gpus-per-task; the mapped ones with --gpu-bind=map_gpu."""
    everything = [str(i) for i in range(gpus_on_node)]
    bind = re.sub(r"^verbose,", "", (job.gpu_bind or "").lower())
    if bind.startswith("map_gpu:") and re.fullmatch(r"[0-9*,]+", bind.split(":", 1)[1]):
        ids = [x for x in bind.split(":", 1)[1].split(",") if x]
        entry = ids[local_rank % len(ids)]
        return [entry.split("*")[0]]
    if bind.startswith("per_task:") and whole_number(bind.split(":", 1)[1]):  # ASCII digits, bounded (kit.bounded)
        n = whole_number(bind.split(":", 1)[1])
        return everything[local_rank * n:(local_rank + 1) * n]
    if bind.startswith("single:") and whole_number(bind.split(":", 1)[1]):
        # one GPU per task, N tasks per GPU, the first GPU with room (srun(1) --gpu-bind): which one also depends
        # on the task's socket, so the ids are the order without NUMA; the count is exact
        return [everything[local_rank // whole_number(bind.split(":", 1)[1]) % len(everything)]] if everything else []
    if bind in ("", "none") and job.gpus_per_task and bind != "none":
        g = job.gpus_per_task
        return everything[local_rank * g:(local_rank + 1) * g]
    return everything


def allocation_tasks(job: Job, findings: Findings) -> tuple[list[int] | None, int]:
    """What the allocation holds on each node, in tasks (None: Slurm decides by free cores), the job's task count
    (which srun inherits, as SLURM_NTASKS or, without -n, one per node): slurm-wlm 22.05's placement as measured on
    the test cluster (docs/checker.md, section 10)."""
    n, k, cap = job.ntasks, job.ntasks_per_node, node_cap(job)
    nodes = job.nodes
    if nodes is None:
        if n and k:
            nodes = -(-n // k)
        elif n and not k and cap and n > cap:
            nodes = -(-n // cap)
        else:
            nodes = 1
        if n and n > 1 and not k:
            findings.warn("nodes-missing", f"--nodes is not given: Slurm picks the node count for --ntasks={n}; "
                          f"assuming {nodes} node(s); add --nodes={nodes}")
        job.nodes = nodes
    if k:
        total = n if n is not None else nodes * k
        if total > nodes * k:
            findings.error("ntasks-mismatch",
                           f"--ntasks={total} exceeds --nodes={nodes} x --ntasks-per-node={k} = {nodes * k}: sbatch "
                           "refuses it ('Requested node configuration is not available'); set "
                           f"--ntasks={nodes * k} or drop --ntasks")
            total = nodes * k
        # with --ntasks the allocation holds the cores of those n tasks only, at most k a node, on at most n nodes
        # (measured: -N 1 -n 1 --ntasks-per-node 2 -c 1 refused srun -n 2, 'More processors requested than
        # permitted'; -N 2 -n 1 --ntasks-per-node 1 -c 10 ran srun -n 4 on its one node)
        return spread(total, [k] * min(nodes, total)), total
    if n is None:  # one task per node, and srun inherits that count like a -n (srun -N 1 in -N 2 was refused)
        return [1] * nodes, nodes
    if n < nodes:
        findings.error("ntasks-below-nodes", f"--ntasks={n} is below --nodes={nodes}: every node needs a task; "
                       f"use --nodes={n}")
        job.nodes = n
        return [1] * n, n
    if nodes == 1 or n == nodes:
        return [n // nodes] * nodes, n
    if cap and n == nodes * cap:
        return [cap] * nodes, n  # full nodes: no other packing fits
    return None, n


def spread(ntasks: int, caps: list[int]) -> list[int]:
    """srun's default block distribution over the allocation: one task per node per round, a node taking no more
    than it holds (srun -n 5 in 4(x3) gave 2,2,1; -n 4 in 2(x3) gave 2,1,1). Computed by levels, not round by
    round, so that thousands of nodes cost no more than a sort."""
    n = min(ntasks, sum(caps))
    level, placed = 0, 0  # the round every node with room still gets a task in
    for cap in sorted(set(caps)):
        full = sum(1 for c in caps if c > level)
        if placed + full * (cap - level) > n:
            break
        placed += full * (cap - level)
        level = cap
    rounds, extra = divmod(n - placed, max(1, sum(1 for c in caps if c > level)))
    counts = [min(c, level + rounds) for c in caps]
    for i, c in enumerate(caps):
        if extra and c > level + rounds:
            counts[i] += 1
            extra -= 1
    return counts


def packing(ntasks: int, nodes: int, cap: int | None) -> list[int]:
    """One placement of free-core packing: the first nodes filled, one task left for each other node (what idle
    nodes gave: -n 6 -N 3 -> 4,1,1; -n 9 -N 3 -> 7,1,1)."""
    counts, left = [], ntasks
    for i in range(nodes):
        take = max(1, min(cap or ntasks, left - (nodes - i - 1)))
        counts.append(take)
        left -= take
    return counts


def step_placement(job: Job, findings: Findings, kit: bool = True) -> list[int]:
    """Tasks on each node of a launch line's step (the trainer's by default), as Slurm places them: the
    allocation's shape, then srun's options on the line, which override it (srun -n K alone inherits the job's
    nodes); one task on the first node for a line the batch shell runs itself."""
    if job.tasks_per_node:  # inside an allocation: Slurm already placed them
        return list(job.tasks_per_node)
    caps, ntasks = allocation_tasks(job, findings)
    nodes = len(caps) if caps else job.nodes
    if job.srun is False:  # the batch step runs the line once: SLURM_PROCID=0, no SLURM_STEP_ID (measured)
        own = job.workers is not None or not kit  # torchrun, or a program that may start its own processes
        if nodes > 1 or (ntasks > 1 and not own):
            what = f"the trainer's line starts with '{job.launcher}'" if kit else (
                f"{job.trainer} is started by '{job.launcher or job.trainer}'")
            findings.error("trainer-without-srun",
                           f"{what}, not srun: in a job of {ntasks} task(s) on {nodes} node(s) the batch script runs "
                           f"it once, on the first node"
                           + (f", as 1 process, not {ntasks}" if not own else f"; the other {nodes - 1} node(s) "
                              "idle") + "; start it with srun"
                           + (f": srun python {job.trainer} ..." if kit and job.workers is None else
                              " --ntasks-per-node=1 (one per node)"))
        return [1]
    placed = step_tasks_per_node(job, caps, ntasks, nodes, findings)
    implicit = (job.ntasks is None and not job.ntasks_per_node and job.step_cpus_per_task
                and implicit_ntasks(job) is None)  # srun counts its tasks by -c
    if ((job.step_ntasks is None and job.step_nodes is None) or job.placement == "possible") and not implicit:
        check_allocation_shape(job, caps, ntasks, findings, kit)  # the job's shape
    return placed


def step_tasks_per_node(job: Job, caps: list[int] | None, ntasks: int, nodes: int, findings: Findings) -> list[int]:
    """srun's placement of the trainer's step in the allocation (caps: tasks it holds per node, None: packed by
    free cores), with srun's own -N / -n / --ntasks-per-node / -c from the trainer's line."""
    k_step, m_step, j_step, c_step = job.step_ntasks, job.step_nodes, job.step_ntasks_per_node, job.step_cpus_per_task
    cores = allocation_cores(job, caps, ntasks) if caps is not None else None
    n_step = k_step if k_step is not None else ntasks  # srun inherits the job's task count (SLURM_NTASKS)
    if k_step is None and job.ntasks is None and not job.ntasks_per_node and cores and implicit_ntasks(job) is None:
        # without SLURM_NTASKS srun counts its tasks itself (srun/libsrun/srun_job.c _set_ntasks): -N x
        # --ntasks-per-node, else with -c the cores each node holds // -c (measured: a --cpus-per-gpu=24 job of 4
        # GPUs holds 96 cores and `srun -c 48` ran 2 tasks), else one a node
        if j_step:
            n_step = (m_step or nodes) * j_step
        elif c_step:
            n_step = max(len(cores), sum(c // c_step for c in cores))
    # srun: "can't run K processes on M nodes, setting nnodes to K" (measured), else the job's nodes
    m_step = min(m_step, n_step) if m_step else min(nodes, n_step)
    if m_step > nodes:
        findings.error("step-nodes", f"srun -N {m_step} but the job has {nodes} node(s): srun refuses the step; "
                       f"use srun -N <= {nodes}")
        m_step = nodes
    if j_step and n_step != m_step * j_step:
        findings.warn("srun-ntasks-per-node-ignored",
                      f"srun --ntasks-per-node={j_step} does not match {n_step} task(s) on {m_step} node(s): srun "
                      "ignores it ('can't honor --ntasks-per-node', measured); drop it or use srun "
                      f"-n {m_step * j_step}")
        j_step = None
    if caps is None:
        if j_step and j_step > 1:
            findings.error("srun-ntasks-per-node-conflict",
                           f"srun --ntasks-per-node={j_step} in an allocation packed by free cores (some nodes may "
                           f"hold 1 task): Slurm then overcommits unevenly (measured: 3,2,1 for -N3 -n6 and srun "
                           f"--ntasks-per-node=2); request --ntasks-per-node={j_step} in #SBATCH")
        elif n_step == m_step:
            return [1] * m_step
        job.placement = "possible"  # go on with one packing Slurm may make (what idle nodes got)
        caps = packing(ntasks, nodes, node_cap(job))
        cores = allocation_cores(job, caps, ntasks)
    # the step fits its tasks in the allocation's cores; srun 22.05 does not read SLURM_CPUS_PER_TASK, so without
    # srun -c a task takes 1 core (measured: docs/checker.md, section 10)
    caps = [c // (c_step or 1) for c in cores[:m_step]]
    if n_step > sum(caps):
        held = ",".join(map(str, cores[:m_step]))
        findings.error("step-too-many-tasks",
                       f"srun would start {n_step} task(s)" + (f" of -c {c_step} core(s)" if c_step else "")
                       + f" on {m_step} node(s) whose allocation holds {held} core(s): srun "
                       + ("may refuse" if job.placement == "possible" else "refuses") + " the step ('More processors "
                       "requested than permitted', measured); "
                       + (f"use srun -n <= {sum(caps)}" if sum(caps) else
                          f"use srun -c <= {max(cores[:m_step] or [1])}"))
        return caps if sum(caps) else [1] * m_step
    if j_step and any(c < j_step for c in caps):
        findings.error("srun-ntasks-per-node-conflict",
                       f"srun --ntasks-per-node={j_step} on nodes holding {','.join(map(str, caps))} task(s): Slurm "
                       "then overcommits unevenly (measured: 3,2,1 for -N3 -n6 and srun --ntasks-per-node=2); "
                       f"request --ntasks-per-node={j_step} in #SBATCH")
        job.placement = "possible"
        return packing(n_step, m_step, None)
    return [j_step] * m_step if j_step else spread(n_step, caps)


def allocation_gpus(job: Job, tasks: int) -> int | None:
    """GPUs the allocation gives a node holding `tasks` tasks (--gres, --gpus-per-node, --gpus-per-task x tasks, or
    a one-node --gpus); None when not known here."""
    per_node = job.gres_gpus or job.gpus_per_node or (job.gpus_per_task * tasks if job.gpus_per_task else None)
    if per_node is None and job.gpus_total and (job.nodes or 1) == 1:
        per_node = job.gpus_total
    return per_node


def allocation_cores(job: Job, caps: list[int], ntasks: int) -> list[int]:
    """The cores the allocation holds on each node (SLURM_JOB_CPUS_PER_NODE): its tasks x --cpus-per-task, or
    --cpus-per-gpu x the node's GPUs where that is more (measured: 8 tasks with 2 GPUs at --cpus-per-gpu=2 held 8
    cores; 2 tasks with 4 GPUs at 24 held 96). With --ntasks-per-node and several tasks slurmctld reserves k tasks'
    cores on every node, whatever -n (job_mgr.c: pn_min_cpus = cpus_per_task x k)."""
    held = [max(c, job.ntasks_per_node) if job.ntasks_per_node and ntasks > 1 else c for c in caps]
    cores = []
    for h in held:
        gpus = allocation_gpus(job, h) if job.cpus_per_gpu else None
        cores.append(max(h * (job.cpus_per_task or 1), (gpus or 0) * (job.cpus_per_gpu or 0)))
    job.cores_per_node = cores
    return cores


def check_allocation_shape(job: Job, caps: list[int] | None, ntasks: int, findings: Findings,
                           kit: bool = True) -> None:
    """The #SBATCH task counts: --ntasks-per-node missing, or a maximum because --ntasks asks fewer. The warnings
    about SLURM_NTASKS_PER_NODE are for the kit's trainer (the page's code reads it); the errors (tasks placed
    unevenly) hold for any program."""
    n, k, nodes = job.ntasks, job.ntasks_per_node, job.nodes or 1
    if k and n is not None and n < nodes:
        findings.error("ntasks-below-nodes", f"--ntasks={n} is below --nodes={nodes}: srun runs on {n} node(s) "
                       f"only ('can't run {n} processes on {nodes} nodes', measured) and the others idle; use "
                       f"--nodes={n}")
    elif k and n is not None and caps and n < nodes * k:
        placed = spread(n, caps)
        if len(set(placed)) > 1:
            findings.error("ntasks-mismatch",
                           f"--ntasks={n} with --nodes={nodes} x --ntasks-per-node={k} = {nodes * k}: "
                           f"--ntasks-per-node is then a maximum and srun places {','.join(map(str, placed))} "
                           f"(measured); set --ntasks={nodes * k} or drop --ntasks")
        elif kit:
            findings.warn("ntasks-per-node-max",
                          f"--ntasks={n} on {nodes} node(s) runs {placed[0]} task(s) per node, below "
                          f"--ntasks-per-node={k} (a maximum when --ntasks is given): SLURM_NTASKS_PER_NODE={k} then "
                          f"misleads the page's code; set --ntasks-per-node={placed[0]}")
    if k:
        return
    if not kit and (n is None or n == nodes or nodes == 1 or caps):
        return
    if n is None or n == nodes:
        findings.warn("ntasks-per-node-missing",
                      "--ntasks-per-node is not given: Slurm runs 1 task per node (pure model parallel inside "
                      "each node) and SLURM_NTASKS_PER_NODE does not exist for the page's code; add "
                      "--ntasks-per-node=1 to say so")
    elif nodes == 1 or caps:
        findings.warn("ntasks-per-node-missing",
                      f"--ntasks-per-node is not given: SLURM_NTASKS_PER_NODE will not exist for the page's code; "
                      f"add --ntasks-per-node={n // nodes}")
    elif n % nodes:
        findings.error("ntasks-per-node-missing",
                       f"--ntasks={n} on --nodes={nodes} cannot be even ({n} tasks don't split over {nodes} nodes) "
                       f"and, without --ntasks-per-node, Slurm packs them by free cores (-n 6 -N 3 gave 4,1,1 on the "
                       f"test cluster): nodes get different nb_part; use --ntasks a multiple of {nodes} with "
                       f"--ntasks-per-node")
    else:
        findings.error("ntasks-per-node-missing",
                       f"--ntasks={n} on --nodes={nodes} without --ntasks-per-node may pack unevenly: Slurm packs "
                       f"tasks by free cores (-n 6 -N 3 gave 4,1,1 on the test cluster), so nodes can get "
                       f"different nb_part; add --ntasks-per-node={n // nodes}")


def step_gpus_per_node(job: Job, tasks_per_node: list[int], findings: Findings) -> int | None:
    """GPUs per node from --gres, --gpus-per-node, --gpus-per-task and --gpus, with the pairs Slurm refuses or
    resolves against the user, as slurm-wlm 22.05 did on the test cluster (docs/checker.md, section 10) and
    SchedMD's testsuite (testsuite/expect/test39.4) expects from later releases."""
    gres, gpn, gpt, total = job.gres_gpus, job.gpus_per_node, job.gpus_per_task, job.gpus_total
    nodes, busiest = len(tasks_per_node), max(tasks_per_node)
    if gres and gpn and gres != gpn:
        findings.error("gpu-request-conflict",
                       f"--gres=gpu:{gres} and --gpus-per-node={gpn} both set the GPUs per node: Slurm 22.05 accepts "
                       f"the job with --gres's {gres} and every srun step then fails ('Step requested "
                       f"gres_per_node=gpu:{gpn} is more than the job's gres_per_node=gpu:{gres}', measured in "
                       f"either order); keep one of them")
    per_node = gres or gpn
    if per_node and gpt and gpt * busiest != per_node:
        findings.error("gpu-request-conflict",
                       f"--gpus-per-task={gpt} x {busiest} task(s) per node = {gpt * busiest} GPUs disagrees with "
                       f"{'--gres=gpu:' if gres else '--gpus-per-node='}{per_node}: sbatch refuses the job ('Failed to "
                       "validate job spec. Based on --gres=gpu/--gpus-per-node and --gpus-per-task requested number of "
                       "tasks per node differ from --ntasks-per-node.', measured); keep one of them")
    if per_node and total and total != per_node * nodes:
        findings.error("gpu-request-conflict",
                       f"--gpus={total} disagrees with {'--gres=gpu:' if gres else '--gpus-per-node='}{per_node} "
                       f"x {nodes} node(s) = {per_node * nodes}: sbatch refuses the job ('--gpus is not multiple of "
                       f"--gres=gpu/--gpus-per-node', measured for --gres=gpu:2 --gpus=3); drop --gpus")
    if per_node is None and gpt:
        per_node = gpt * busiest
    ntype = node_type(job)
    full = JEAN_ZAY[ntype].gpus if ntype else None
    if per_node is None and total and nodes > 1 and full and total == full * nodes:
        per_node = full  # every node must give all its GPUs: Slurm has no choice (-N 2 --gpus=8 gave 4 and 4)
    elif per_node is None and total and nodes > 1 and total < nodes:
        findings.error("gpu-request-conflict", f"--gpus={total} on {nodes} nodes: sbatch refuses it ('Failed to "
                       f"validate job spec, --gpus < -N', measured); ask for --gpus-per-node=N")
        per_node = 1
    if per_node is None and total:
        if nodes > 1:
            even = total // nodes if total % nodes == 0 else None
            findings.error("gpus-total-multinode",
                           f"--gpus={total} is a total for {nodes} nodes: Slurm does not promise an even split "
                           f"(measured: --gpus=6 on 2 nodes gave 4 and 2 GPUs), so nb_part can differ from node to "
                           f"node; " + (f"use --gpus-per-node={even} or --gres=gpu:{even}" if even else
                                        f"use --gres=gpu:N with N x {nodes} GPUs in all"))
            per_node = max(1, total // nodes)
        else:
            per_node = total
    return per_node
